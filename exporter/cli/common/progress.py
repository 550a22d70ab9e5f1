"""The recording's progress line on stderr (trace --db)."""

from __future__ import annotations

import time


class Progress:
    """The recording's progress on stderr: rewritten in place on a terminal
    (every second), one line every PLAIN_EVERY_S seconds otherwise."""

    PLAIN_EVERY_S = 5.0

    def __init__(self, recorder, stream):
        self.recorder = recorder
        self.stream = stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.every = 1.0 if self.tty else self.PLAIN_EVERY_S
        self.t0 = self.last = time.monotonic()
        self.last_offered = 0

    def line(self, now: float) -> str:
        r = self.recorder
        rate = (r.offered - self.last_offered) / max(now - self.last, 1e-9)
        return (f"recording {now - self.t0:6.1f} s: {rate:8.0f} events/s, "
                f"{r.total_recorded} recorded, {r.queued} queued, {r.total_lost} lost")

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.last < self.every:
            return
        text = self.line(now)
        self.last, self.last_offered = now, self.recorder.offered
        self.stream.write(("\r" + text + "\x1b[K") if self.tty else text + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
