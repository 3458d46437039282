"""Which runs this engine judges: those of the partitions its consumer group gave it.

Records are keyed by run (topics.record_key) and the group's range assignor gives
partition p of every record topic to one member, so a run is read whole, every rank and
kind of it, by exactly one engine of the group. At a rebalance this engine keeps its
state of the partitions it keeps, drops the runs of those it lost (another engine judges
them now) and replays the ones it gained from the topics as warm-up, as at a start
without a checkpoint. No Kafka here: the service asks the broker and seeks.
"""

from __future__ import annotations

from ...kafka_client import TopicPartition

Partition = tuple[str, int]  # (topic, partition); a TopicPartition is one too


class Ownership:
    def __init__(self):
        self.assigned: set[TopicPartition] = set()
        # Per partition, the next offset this engine's state of its runs includes: where
        # reading it continues, should it stay (or come back from a checkpoint).
        self.held: dict[Partition, int] = {}
        # Records below these offsets were judged already (by this engine before a restart,
        # or by another before a rebalance): replayed to fill windows, nothing fires.
        self.warm_until: dict[Partition, int] = {}
        self.run_partition: dict[str, int] = {}  # run -> the partition number it is read from

    def restore(self, offsets: dict[str, int], run_partitions: dict[str, int]) -> None:
        """From a checkpoint: its offsets ("topic:partition" -> next) and its runs' partitions."""
        self.held = {}
        for name, offset in offsets.items():
            topic, _, partition = name.rpartition(":")
            self.held[TopicPartition(topic, int(partition))] = offset
        self.run_partition = dict(run_partitions)

    def checkpoint_offsets(self) -> dict[str, int]:
        return {f"{topic}:{partition}": offset for (topic, partition), offset in self.held.items()}

    def saw(self, topic: str, partition: int, offset: int, run_id: str) -> bool:
        """A record read; True if it is warm-up."""
        key = (topic, partition)
        self.held[key] = offset + 1
        self.run_partition[run_id] = partition
        return offset < self.warm_until.get(key, -1)

    def warming(self) -> bool:
        """Whether a partition is still being replayed as warm-up."""
        return any(self.held.get(tp, 0) < until for tp, until in self.warm_until.items())

    def assign(self, partitions: list[TopicPartition]) -> list[str]:
        """The group's new assignment (all of it: the range assignor is eager). Returns the
        runs read from partition numbers this engine no longer holds: they are another
        engine's now, or nobody's until the group settles."""
        self.assigned = set(partitions)
        self.held = {tp: o for tp, o in self.held.items() if tp in self.assigned}
        self.warm_until = {tp: o for tp, o in self.warm_until.items() if tp in self.assigned}
        numbers = {tp.partition for tp in partitions}
        return [run for run, p in self.run_partition.items() if p not in numbers]

    def start(self, tp: TopicPartition, committed: int | None, rebuild_records: int) -> int | None:
        """Where to seek ``tp`` to (None: read on from the group's committed offset): where
        this engine's state of its runs continues, else ``rebuild_records`` before the
        committed offset. Records up to the committed offset are warm-up."""
        start = self.held.get(tp)
        if start is None and committed and rebuild_records:
            start = max(0, committed - rebuild_records)
        # Held from now on even before a record comes: kept at the next rebalance, it is
        # read on from here, not rewound and replayed into windows that have it already.
        self.held[tp] = start if start is not None else (committed or 0)
        if start is not None and committed and start < committed:
            self.warm_until[tp] = max(committed, self.warm_until.get(tp, 0))
        return start

    def revoke(self, partitions: list[TopicPartition]) -> None:
        self.assigned = self.assigned - set(partitions)  # a new set: others may be iterating

    def holds_all_of(self, topic: str, partitions: list[int]) -> bool:
        """Every partition of ``topic`` with a number this engine holds is assigned to it
        (a topic created since the last rebalance is not, until the next)."""
        numbers = {tp.partition for tp in self.assigned}
        return all(TopicPartition(topic, p) in self.assigned for p in partitions if p in numbers)

    def prune(self, known_runs: set[str]) -> None:
        """Forget the partitions of runs the engine no longer knows at all."""
        self.run_partition = {r: p for r, p in self.run_partition.items() if r in known_runs}
