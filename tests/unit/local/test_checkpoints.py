"""Checkpoint stores: positions by mapping and shard, durable in a state directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from shoal.local.checkpoints import FileCheckpoints, MemoryCheckpoints, Position


def test_file_checkpoints_are_read_back_by_a_new_store(tmp_path: Path) -> None:
    # Given checkpoints of two shards saved, one of them twice
    store = FileCheckpoints(tmp_path)
    store.save("m-1", "shardId-000000000000", Position.after(3))
    store.save("m-1", "shardId-000000000001", Position.at(7))
    store.save("m-1", "shardId-000000000000", Position.after(5))

    # When a new store opens the directory (a restart)
    reopened = FileCheckpoints(tmp_path)

    # Then it finds the last position of each shard, and no temporary file is left
    assert reopened.load("m-1", "shardId-000000000000") == Position.after(5)
    assert reopened.load("m-1", "shardId-000000000001") == Position.at(7)
    assert reopened.load("m-2", "shardId-000000000000") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-1.json"]


def test_file_checkpoints_keep_a_time_position(tmp_path: Path) -> None:
    # Given an AT_TIMESTAMP position (a seek to a time)
    FileCheckpoints(tmp_path).save("m-1", "s", Position("AT_TIMESTAMP", timestamp=1700000000.5))

    # When read back / Then it is the same position
    assert FileCheckpoints(tmp_path).load("m-1", "s") == Position(
        "AT_TIMESTAMP", timestamp=1700000000.5
    )


def test_deleting_a_mapping_forgets_its_checkpoints_only(tmp_path: Path) -> None:
    # Given checkpoints of two mappings
    store = FileCheckpoints(tmp_path)
    store.save("m-1", "s", Position.after(1))
    store.save("m-2", "s", Position.after(2))

    # When one mapping is deleted
    store.delete_mapping("m-1")

    # Then only its checkpoints are gone, also for a new store
    assert FileCheckpoints(tmp_path).load("m-1", "s") is None
    assert FileCheckpoints(tmp_path).load("m-2", "s") == Position.after(2)


def test_a_mapping_id_cannot_name_a_path_outside_the_directory(tmp_path: Path) -> None:
    # Given/When a mapping id with a path in it / Then the store refuses it
    with pytest.raises(ValueError, match="uuid"):
        FileCheckpoints(tmp_path / "cp").save("../escape", "s", Position.after(1))


def test_memory_checkpoints_forget_a_deleted_mapping() -> None:
    # Given a checkpoint in memory
    store = MemoryCheckpoints()
    store.save("m-1", "s", Position.after(4))
    assert store.load("m-1", "s") == Position.after(4)

    # When its mapping is deleted / Then it is gone
    store.delete_mapping("m-1")
    assert store.load("m-1", "s") is None


def test_a_sequence_position_needs_a_sequence_number() -> None:
    # Given/When a sequence position without a number / Then it is refused
    with pytest.raises(ValueError, match="sequence number"):
        Position("AFTER_SEQUENCE_NUMBER")
