"""SIGTERM ends the daemon within its deadline, whatever the main thread is doing when the signal lands.

How a daemon outlived `systemctl stop` (docs/reliability.md): the SIGTERM handler logged, and a handler runs on
the main thread between two bytecodes, possibly while that thread is inside structlog's PrintLogger writing a
line, holding its (non re-entrant) write lock. The handler's own log call then waits for that lock forever
(`py-spy dump` of the old code under this test: MainThread in PrintLogger.msg, called from the handler, called
from PrintLogger.msg). The test delivers the signal at exactly that point, in a subprocess with a deadline, so the
old code fails by timing out instead of hanging the suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SIGNAL_DURING_A_LOG_WRITE = textwrap.dedent("""
    import signal, sys
    from reconciler.edge import log
    from reconciler.loop.daemon import Daemon
    from reconciler.loop.reasons import Reason

    class SignalsDuringWrite:
        '''stderr whose first write delivers SIGTERM: the handler runs while the log writer holds its lock.'''
        def __init__(self, real):
            self.real, self.fired = real, False
        def write(self, text):
            if not self.fired:
                self.fired = True
                signal.raise_signal(signal.SIGTERM)
            return self.real.write(text)
        def flush(self):
            self.real.flush()

    sys.stderr = SignalsDuringWrite(sys.__stderr__)
    log.configure(json_lines=True)
    controller = Daemon(sys.argv[1], sys.argv[2])
    controller.install_signals()
    controller.log.info("reconcile.end", phase="Converged")   # the main thread's own log line
    assert sys.stderr.fired, "the signal was delivered inside the write"
    assert controller.stop.is_set() and controller.cancel.is_set(), "the handler asked the loop to stop"
    assert controller.requests.wait(timeout=0) == {Reason("signal")}, "and woke it"
    print("stopped cleanly")
""")


def test_sigterm_while_the_main_thread_writes_a_log_line_does_not_deadlock(tmp_path):
    desired = tmp_path / "cluster.yaml"
    desired.write_text("not read by this test\n")
    result = subprocess.run([sys.executable, "-c", SIGNAL_DURING_A_LOG_WRITE, str(desired), str(tmp_path / "state")],
                            capture_output=True, text=True, timeout=20, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "stopped cleanly"
