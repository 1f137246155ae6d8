"""`manage.py up` stopping its children."""

import os
import signal
import subprocess
import sys
import threading
import time

from portal.management.commands import up

STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"
)


def test_asked_again_while_stopping_it_kills_the_children_that_linger(monkeypatch):
    """A child that ignores SIGTERM would hold `up` for STOP_SECONDS; a second Ctrl-C
    kills it at once instead of leaving it running behind a traceback."""
    monkeypatch.setattr(up, "STOP_SECONDS", 60)
    stubborn = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    assert stubborn.stdout.readline().strip() == "ready"
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    second_ctrl_c = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    started = time.monotonic()
    try:
        second_ctrl_c.start()
        up.stop({"quick": quick, "stubborn": stubborn})
    finally:
        second_ctrl_c.cancel()
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
        stubborn.stdout.close()

    assert quick.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 30  # not the 60 s it would have waited


def test_a_child_that_a_ctrl_c_stopped_first_is_a_clean_stop_not_an_error():
    """Ctrl-C reaches every process of the terminal: the web server may exit 0 before `up`
    sees its own SIGINT (issue: `CommandError: web exited with code 0`, make: Error 1)."""
    import pytest
    from django.core.management.base import CommandError

    stopped = subprocess.Popen([sys.executable, "-c", "pass"])
    stopped.wait()
    with pytest.raises(KeyboardInterrupt):
        up.check_alive({"web": stopped})

    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    failed.wait()
    with pytest.raises(CommandError, match="web exited with code 3"):
        up.check_alive({"web": failed})
