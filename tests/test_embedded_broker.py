"""The embedded broker's exchange tables (portal/celery.py): a table another process has made
but not yet written is a new one, never a JSONDecodeError that kills a starting worker."""

from kombu import Connection

from portal.celery import AtomicFilesystemChannel


def channel(folder) -> AtomicFilesystemChannel:
    options = {"data_folder_in": str(folder), "data_folder_out": str(folder), "control_folder": str(folder / "control")}
    conn = Connection("filesystem://", transport="portal.celery:AtomicFilesystemTransport", transport_options=options)
    return conn.default_channel


def test_a_table_made_but_not_yet_written_by_another_process_is_bound_to_and_read(tmp_path):
    ch = channel(tmp_path)
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "celery.pidbox.exchange").touch()  # kombu's binder between its open and its lock

    assert ch.get_table("celery.pidbox") == []
    ch._queue_bind("celery.pidbox", "", "", "agent-a.pidbox")
    ch._queue_bind("celery.pidbox", "", "", "agent-b.pidbox")
    ch._queue_bind("celery.pidbox", "", "", "agent-a.pidbox")  # bound once

    assert [q.queue for q in ch.get_table("celery.pidbox")] == ["agent-b.pidbox", "agent-a.pidbox"]
    assert [q.queue for q in channel(tmp_path).get_table("celery.pidbox")] == ["agent-b.pidbox", "agent-a.pidbox"]
