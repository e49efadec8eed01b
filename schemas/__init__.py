"""The contract between `prep` and `train`: one definition of every record and rule that crosses the boundary.

    manifest.py     SampleRecord / RejectRecord (+ SampleRecord.problems: what a consistent sample is)
    shard.py        the tar layout of a sample and ShardReader, the one reader of it
    build.py        BuildRecord: build.json, typed
    prompt.py       the prompt layouts (nested, flat) and their exact tokenization
    answer.py       the answer format: render and strict parse
    annotations.py  what a row of the annotations file means
    predictions.py  a row of preds.jsonl
    versions.py     the package versions every record notes
prep and train both import it; it imports neither (tests/test_contract.py).
"""
from schemas.manifest import (
    SCHEMA_VERSION,
    RejectRecord,
    SchemaError,
    SampleRecord,
    Segment,
    arrow_schema,
    from_dict,
    read_records,
    write_records,
)

__all__ = ["SCHEMA_VERSION", "RejectRecord", "SchemaError", "SampleRecord", "Segment", "arrow_schema", "from_dict", "read_records", "write_records"]
