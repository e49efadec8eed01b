"""The manifest contract: one definition, derived arrow schema, documented verbatim in the README."""
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from schemas import RejectRecord, SampleRecord, Segment, arrow_schema, read_records, write_records
from schemas.__main__ import schema_docs
from tests.records import v2_fields


def _record(**kw) -> SampleRecord:
    base = dict(sample_id="v/w0000", video_id="v", source_path="v.mp4", window_index=0, window_start_s=0.0,
                window_end_s=16.0, num_frames=2, frame_indices=[0, 30], frame_times_s=[0.0, 1.0],
                group_times_s=[0.5], height=64, width=64, grid_t=1, grid_h=4, grid_w=4, visual_tokens=4,
                text_tokens=20, supervised_tokens=5, input_tokens=24, query="q", answer="[[1.0, 2.0]]",
                segments=[Segment(start_s=1.0, end_s=2.0)], shard="shard-000000.tar", key="v_w0000",
                **v2_fields(2, fps=30.0))
    return SampleRecord(**{**base, **kw})


def test_round_trip_keeps_every_field_and_the_version(tmp_path):
    records = [_record(), _record(sample_id="v/w0001", segments=[])]
    write_records(tmp_path / "m.parquet", records, SampleRecord)
    table = pq.read_table(tmp_path / "m.parquet")
    assert table.schema.metadata[b"video_ora.schema_version"] == b"2"
    assert [f.name for f in table.schema] == [f.name for f in arrow_schema(SampleRecord)]
    assert read_records(tmp_path / "m.parquet", SampleRecord) == records


def test_reading_the_wrong_record_kind_names_both(tmp_path):
    write_records(tmp_path / "r.parquet", [RejectRecord(video_id="v", source_path="v.mp4", stage="probe",
                                                        reason="zero_byte_file", detail="0 bytes")], RejectRecord)
    with pytest.raises(ValueError, match="RejectRecord.*SampleRecord"):
        read_records(tmp_path / "r.parquet", SampleRecord)


def test_readme_documents_the_schema_verbatim():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert schema_docs() in readme, "README schema section is stale: paste the output of `python -m schemas`"
