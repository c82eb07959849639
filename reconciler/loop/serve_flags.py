"""What the serving image says of itself (`vllm serve --help=all`: its flags, its vLLM version), for the daemon.

Asking takes tens of seconds (it imports torch), so it is asked beside the loop (`operations.FlagsQuery`, whose
answer requests a reconcile) for every image id an observation sees, a start planned or not: its answer is ready
when one is. Each question runs under the reference of the deployment that wants that image (the edge's
`image_flags.ask_serve_flags`); /status shows the answer about the first deployment's image.
"""

from __future__ import annotations

from collections.abc import Callable

from reconciler.core import spec
from reconciler.core.observed import Observed, ServeFlags
from reconciler.edge.image_flags import ask_serve_flags
from reconciler.edge.observe import with_flags
from reconciler.edge.ssh import Sessions
from reconciler.loop.operations import FlagsQuery


class ImageFlags:
    """`desired` and `sessions`: the controller's as they are when a question runs (on its own thread)."""

    def __init__(self, on_answer: Callable[[], None], desired: Callable[[], spec.Desired | None],
                 sessions: Callable[[], Sessions | None]) -> None:
        self._desired = desired
        self._sessions = sessions
        self._asking: dict[str, spec.Desired] = {}  # image id -> the deployment whose image it is (_ask)
        self.query = FlagsQuery(self._ask, on_answer=on_answer)
        self.answer: ServeFlags | None = None  # what the serving image said of itself, for /status

    def annotate(self, desired: spec.Desired, observed: Observed) -> Observed:
        """`observed` with the answers at hand about every image id it saw (pending ones asked beside the loop)."""
        observed = with_flags(desired, observed, self._flags_of, starting_only=False)
        self.answer = observed.view(desired.deployment_names[0]).serve_flags  # /status: the image's vLLM
        return observed

    def status(self) -> dict[str, object] | None:
        """/status's `image`: the first deployment's image as it answered (None: not asked yet)."""
        flags = self.answer
        return None if flags is None else {"id": flags.image_id, "vllm_version": flags.version,
                                           "pending": flags.pending, "error": flags.error}

    def _flags_of(self, view: spec.Desired, wanted: tuple[str, str]) -> ServeFlags | None:
        """The answer at hand about `view`'s image (a pending one while `FlagsQuery` asks beside the loop)."""
        self._asking[wanted[1]] = view
        return self.query.get(wanted)

    def _ask(self, holder: str, image_id: str) -> ServeFlags:
        """Ask the image `image_id` on `holder`, run under the reference of the deployment that wants it."""
        desired, sessions = self._desired(), self._sessions()
        assert desired is not None and sessions is not None
        return ask_serve_flags(self._asking.get(image_id, desired.views()[0]), sessions, holder, image_id)
