"""Print the record schemas as Markdown tables: `python -m schemas`. The README's schema section is this
output verbatim (a test keeps them equal), so the docs cannot drift from the one definition."""
from __future__ import annotations

import inspect
import re

from schemas.manifest import RejectRecord, SampleRecord, _arrow_type, _fields


def markdown_table(cls: type) -> str:
    comments = dict(re.findall(r"^\s+(\w+): [^#\n]+#\s*(.+)$", inspect.getsource(cls), re.M))
    rows = ["| column | arrow type | meaning |", "| --- | --- | --- |"]
    for f, hint in _fields(cls):
        meaning = comments.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{_arrow_type(hint)}` | {meaning} |".replace("item: ", ""))
    return "\n".join(rows)


def schema_docs() -> str:
    parts = []
    for title, cls in (("manifest.parquet (SampleRecord)", SampleRecord),
                       ("rejects.parquet (RejectRecord)", RejectRecord)):
        parts.append(f"#### {title}\n\n{markdown_table(cls)}\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(schema_docs(), end="")
