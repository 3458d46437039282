"""Class-data sharing (AppCDS) for the JVMs that run Kafka: each start maps in an archive
of the classes a broker loads instead of reading ~7,000 of them out of the jars.

Measured on a 2-core machine (C1 only, serial collector): the storage format 0.86 ->
0.58 s, a broker's start until it answers 1.24 -> 0.88 s. A test session starts dozens.

The archive is made from the classes a broker really loaded, once per jar set: the first
broker started without one records its class list (``-XX:DumpLoadedClassList``) and, once
it answers, :meth:`ClassSharing.make_archive` dumps the archive from it (``java
-Xshare:dump``, ~5 s, in the background so the start does not wait). Every JVM after that
maps it (``-XX:SharedArchiveFile``) when it is the Java the archive was made by; any other
runs as before. A Java that cannot dump one is not asked again. The files live beside the
jars, so a jar set removed takes its archive with it; they are written under a temporary
name and renamed into place, so brokers started at the same moment by other processes see
a whole archive or none.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import subprocess
import time
import uuid
from pathlib import Path

log = logging.getLogger("trainmon.broker")

STALE_RECORDING_S = 300.0  # a start that recorded classes and answered within it made its archive


class ClassSharing:
    """The class-data archive of one jar set, kept in ``directory`` beside the jars: one
    archive, made by the first Java that starts a broker on them. Another Java (a second
    runtime on the machine) runs without one rather than making its own, so the disk holds
    one archive (~60 MB) per jar set, not one per Java ever used."""

    def __init__(self, directory: Path, java: str, classpath: str):
        self.directory = Path(directory)
        self.java, self.classpath = java, classpath
        self.key = hashlib.sha256(f"{java}\0{classpath}".encode()).hexdigest()
        self.archive = self.directory / "kafka.jsa"
        self.archive_key = self.directory / "kafka.jsa.key"  # the Java and classpath it is for
        self.class_list = self.directory / "kafka.classlist"
        self.refused = self.directory / "kafka.refused"  # the Java could not dump one

    def options(self, recording: Path | None = None) -> list[str]:
        """JVM options: map the archive when there is one for this Java and classpath; else
        record the classes loaded into ``recording`` (see :meth:`recording_path`), or nothing."""
        if self._usable():
            return [f"-XX:SharedArchiveFile={self.archive}"]
        if recording is not None:
            return [f"-XX:DumpLoadedClassList={recording}"]
        return []

    def _usable(self) -> bool:
        try:
            return self.archive.exists() and self.archive_key.read_text().strip() == self.key
        except OSError:
            return False

    def recording_path(self) -> Path | None:
        """Where a broker about to start records its classes; None when there is nothing to
        make (an archive is there, or this jar set's Java could not dump one) or the
        directory cannot be written (then brokers run without an archive)."""
        if self.archive.exists() or self.refused.exists():
            return None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Those of starts that never answered (killed, failed) are of no use: a JVM
            # still appending to one writes on unseen.
            for stale in self.directory.glob(f".{self.class_list.name}.*"):
                if time.time() - stale.stat().st_mtime > STALE_RECORDING_S:
                    stale.unlink(missing_ok=True)
        except OSError:
            return None
        return self.directory / f".{self.class_list.name}.{uuid.uuid4().hex}"

    def make_archive(self, recorded: Path) -> None:
        """After a broker that records into ``recorded`` answered (the classes of its start
        are loaded): keep the list as it is now and dump the archive in the background.
        The dump renames its own output into place, so it completes even if this process
        ends first; it exits by itself within seconds."""
        try:
            if self.archive.exists() or not recorded.exists():
                return
            listed = recorded.read_bytes()  # still being appended to: up to its last whole line
            partial_list = recorded.with_name(recorded.name + ".list")
            partial_list.write_bytes(listed[:listed.rfind(b"\n") + 1])
            os.replace(partial_list, self.class_list)
        except OSError as exc:
            log.debug("no class-data archive for Kafka: %s", exc)
            return
        finally:
            recorded.unlink(missing_ok=True)  # the JVM keeps writing to its open file, unseen
        partial = self.directory / f".{self.archive.name}.{uuid.uuid4().hex}"
        dump = [self.java, "-Xshare:dump", f"-XX:SharedClassListFile={self.class_list}",
                f"-XX:SharedArchiveFile={partial}", "-cp", self.classpath]
        partial_q, archive_q = shlex.quote(str(partial)), shlex.quote(str(self.archive))
        key_q, refused_q = shlex.quote(str(self.archive_key)), shlex.quote(str(self.refused))
        script = (f"if {shlex.join(dump)} >/dev/null 2>&1; then echo {self.key} > {key_q}.$$ && "
                  f"mv -f {key_q}.$$ {key_q} && mv -f {partial_q} {archive_q}; "
                  f"else touch {refused_q}; fi; rm -f {partial_q}")
        try:  # detached (the shell that starts it exits at once): nothing to reap here
            subprocess.run(["sh", "-c", f"({script}) &"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True, check=False, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.debug("no class-data archive for Kafka: %s", exc)
