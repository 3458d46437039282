"""The broker JVM's class-data archive: a start records its class list, the archive is
dumped from it in the background, and a JVM started with it really maps Kafka's classes
from it. (Every broker of the suite then starts with the archive of the session's first.)"""

from __future__ import annotations

import os
import subprocess

import pytest

from trainmon.broker import classpath, java
from trainmon.class_sharing import ClassSharing

from .waiting import wait_until

pytestmark = pytest.mark.kafka  # the broker's jars and a Java, no broker


def sharing_in(directory) -> ClassSharing:
    return ClassSharing(directory, java()[0], classpath())


def test_a_recorded_class_list_becomes_an_archive_that_the_jvm_maps(tmp_path):
    sharing = sharing_in(tmp_path / "cds")
    recording = sharing.recording_path()
    assert recording is not None and sharing.options(recording) == [f"-XX:DumpLoadedClassList={recording}"]
    # What a broker's start writes, caught mid-line: the partial last line is left out.
    recording.write_text("java/lang/Object\nkafka/tools/StorageTool\norg/apache/kafka/common/Uu")
    sharing.make_archive(recording)
    assert not recording.exists()
    assert sharing.class_list.read_text().splitlines() == ["java/lang/Object", "kafka/tools/StorageTool"]
    wait_until(sharing.archive.exists, 120, "the archive dumped in the background", pause=0.1)
    assert sharing.options(recording) == [f"-XX:SharedArchiveFile={sharing.archive}"]
    assert sharing.recording_path() is None  # nothing more to record
    other_java = ClassSharing(sharing.directory, "/another/java", sharing.classpath)
    assert other_java.options() == [] and other_java.recording_path() is None  # one archive per jar set

    ran = subprocess.run([sharing.java, *sharing.options(), "-Xlog:class+load=info", "-cp", sharing.classpath,
                          "kafka.tools.StorageTool", "random-uuid"], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert "kafka.tools.StorageTool source: shared objects file" in ran.stdout
    assert not list((tmp_path / "cds").glob(".*")), "a temporary file was left behind"


def test_without_a_writable_directory_brokers_run_without_an_archive(tmp_path):
    (tmp_path / "a-file").write_text("")
    sharing = sharing_in(tmp_path / "a-file" / "cds")
    assert sharing.recording_path() is None
    assert sharing.options(None) == []


def test_a_recording_left_by_a_start_that_never_answered_is_removed_later(tmp_path):
    sharing = sharing_in(tmp_path / "cds")
    left = sharing.recording_path()
    left.write_text("java/lang/Object\n")
    os.utime(left, (0, 0))  # its JVM was killed long ago
    fresh = sharing.recording_path()
    fresh.write_text("java/lang/Object\n")  # another start, recording now
    sharing.recording_path()
    assert not left.exists() and fresh.exists()
