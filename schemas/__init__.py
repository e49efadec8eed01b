"""The contract between `prep` and `train`: one definition of every record that crosses the boundary."""
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
