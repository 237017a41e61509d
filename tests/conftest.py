import logging
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # lets tests import the shared `tiny` / `exact` helpers

import hf_specsample  # noqa: E402,F401  (registers draft_model= on generate())
from hf_specsample import registration  # noqa: E402

# --- The deprecation guard -------------------------------------------------------------------------------------------
# A deprecation message from transformers caused by the project's own calls (the library, the benchmark package, the
# examples and benchmarks) fails the test at the call: the next rename is caught the day its transformers is
# installed, not by a user. A test's own deliberate use of an old name is left alone. "Caused by" is decided on the
# stack: the innermost frame of this repository, outside transformers, torch and the standard library, is the caller.

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TESTS = os.path.join(_REPO, "tests") + os.sep


class OwnDeprecation(AssertionError):
    """transformers deprecated something that the project's own code called."""


def _ours(filename: str) -> bool | None:
    """True: the project's code; False: a test; None: neither (a library, the standard library)."""
    path = os.path.abspath(filename)
    if not path.startswith(_REPO):
        return None
    return not path.startswith(_TESTS)


def _blame(frame) -> str | None:
    """`file:line` of the project's call that led to `frame` (the frame that emitted a message), or None.

    The registered `generate()` wrapper is every model's `generate`: where transformers calls `generate` itself (an
    assistant model's, inside assisted decoding), the wrapper only passes transformers' own call on, so it is not
    the culprit.
    """
    while frame is not None:
        verdict = _ours(frame.f_code.co_filename)
        if verdict is not None:
            wrapper = frame.f_code is registration.generate.__code__
            passed_on = wrapper and _ours(frame.f_back.f_code.co_filename) is None
            return f"{frame.f_code.co_filename}:{frame.f_lineno}" if verdict and not passed_on else None
        frame = frame.f_back
    return None


def _from_transformers(frame) -> bool:
    """transformers' own deprecations, and the ones the registered generate() emits for it (the cache's old name,
    renamed before transformers sees it: `transformers_api.take_caller_cache`)."""
    name = frame.f_code.co_filename
    return f"{os.sep}transformers{os.sep}" in name or name.endswith(
        os.path.join("hf_specsample", "core", "transformers_api.py")
    )


def _emitter(frame):
    """The first frame outside this file and the `warnings` / `logging` modules: whoever emitted the message."""
    while frame is not None and (
        frame.f_code.co_filename == __file__ or frame.f_globals.get("__name__") in ("warnings", "logging")
    ):
        frame = frame.f_back
    return frame


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """`warnings.showwarning` while a test runs: raise for transformers' deprecations of our own calls."""
    emitter = _emitter(sys._getframe(1))
    if (
        issubclass(category, (FutureWarning, DeprecationWarning))
        and emitter is not None
        and _from_transformers(emitter)
    ):
        attributed = _ours(filename)  # the line the warning names: a caller of transformers', or of ours
        culprit = _blame(emitter) if attributed is None else (f"{filename}:{lineno}" if attributed else None)
        if culprit is not None:
            raise OwnDeprecation(f"transformers deprecation caused by {culprit}: {message}")
    warnings._showwarnmsg_impl(warnings.WarningMessage(message, category, filename, lineno, file, line))


class _DeprecationLog(logging.Handler):
    """On transformers' logger: raise for a logged deprecation (`past_key_values` is deprecated...) of our calls."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.WARNING or "deprecat" not in record.getMessage().lower():
            return
        culprit = _blame(_emitter(sys._getframe(1)))
        if culprit is not None:
            raise OwnDeprecation(f"transformers deprecation caused by {culprit}: {record.getMessage()}")


@pytest.fixture(autouse=True)
def _deprecation_guard():
    """Every test runs under the guard; `warning_once` forgets what it said, so each test hears it again."""
    handler = _DeprecationLog()
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    once = getattr(logging.Logger.warning_once, "cache_clear", None)
    if once is not None:
        once()
    shown, warnings.showwarning = warnings.showwarning, _show_warning
    try:
        yield
    finally:
        warnings.showwarning = shown
        transformers_logger.removeHandler(handler)


def thread_share(wanted: int) -> int:
    """Threads a test may use: `wanted`, or this worker's share of the cores where pytest-xdist runs several
    workers (more threads than cores make torch's OpenMP threads wait on each other)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(wanted, (os.cpu_count() or 1) // workers))


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Every test starts from the same global seed; one thread (tiny models only lose by threading)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield


def _timed_forms(monkeypatch, wide_faster_from: int | None = None, **seconds: float) -> list:
    """Make `DraftForm.AUTO`'s timing report these figures per form (tiny models step fastest as given);
    returns the list of timing calls (the number of forms timed in each), so a test can check when timing happened.

    Prompt forwards (`form_choice.time_wide_forwards`, called with [the chosen quantized form, the draft as given])
    are timed faster on the draft as given from `wide_faster_from` positions on (None: never)."""
    from hf_specsample import DraftForm
    from hf_specsample.prepare.form_choice import FormTimings

    figures = {DraftForm(form): value for form, value in seconds.items()}
    calls = []

    def fake(forms, source, target, target_routing, kernel=True):
        calls.append(len(forms))
        return FormTimings({form: figures[form] for form in forms}, 0.01 if target is not None else None)

    def fake_wide(models, width):
        plain_faster = wide_faster_from is not None and width >= wide_faster_from
        return [0.002, 0.001] if plain_faster else [0.001, 0.002]

    monkeypatch.setattr("hf_specsample.prepare.form_choice.time_forms", fake)
    monkeypatch.setattr("hf_specsample.prepare.form_choice.time_wide_forwards", fake_wide)
    return calls


@pytest.fixture
def int8_steps_faster(monkeypatch):
    """AUTO's timing finds the dynamic-int8 copy fastest (as on the AVX2 EPYC measured with real drafts)."""
    return _timed_forms(monkeypatch, dynamic_int8=0.001, as_given=0.002, int8_weights=0.003)


@pytest.fixture
def as_given_steps_faster(monkeypatch):
    """AUTO's timing finds the draft as given fastest (as on a CPU with fast bf16, or with a tiny draft)."""
    return _timed_forms(monkeypatch, dynamic_int8=0.002, as_given=0.001, int8_weights=0.003)


@pytest.fixture
def int8_weights_steps_faster(monkeypatch):
    """AUTO's timing finds the int8-weights copy on the small-rows kernel fastest."""
    return _timed_forms(monkeypatch, dynamic_int8=0.002, as_given=0.003, int8_weights=0.001)


@pytest.fixture
def eager_compiled(monkeypatch):
    """`CompiledForward` running the eager model (its marks, padding and warm-up as compiled code has them): a
    `compile=True` call's caches, pool, padding and rollbacks without minutes of compiling on 2 cores."""
    import hf_specsample.cache.compiled as compiled

    def fresh(self, model):
        self._function = compiled._trampoline
        self._fingerprint = compiled._fingerprint(model) if self.settings.freezes else None
        self.warmed.clear()

    monkeypatch.setattr(compiled.CompiledForward, "_fresh", fresh)


@pytest.fixture(scope="module")
def target():
    """A tiny 64-token target (2 layers): big enough for varied greedy runs, small enough to be instant."""
    from tiny import tiny_lm

    return tiny_lm(seed=0, vocab_size=64, layers=2, hidden=32, init_range=0.3)


@pytest.fixture(scope="module")
def draft(target):
    """A draft close to `target` (its weights plus 10% noise): accepts often, not always."""
    from tiny import perturbed_copy

    return perturbed_copy(target, seed=1, scale=0.1)


@pytest.fixture(scope="module")
def drafts(target):
    """Two drafts for a module's own `target` (the sampling tests' 8-token `tiny_lm(seed=0)`, whose exact
    distribution is small enough to enumerate): "close" (its weights plus 30% noise) and "far" (another random model
    of its vocabulary)."""
    from tiny import perturbed_copy, tiny_lm

    return {
        "close": perturbed_copy(target, seed=1, scale=0.3),
        "far": tiny_lm(seed=2, vocab_size=target.config.vocab_size),
    }


@pytest.fixture(scope="module")
def greedy_models():
    """A target with peaked distributions over 64 tokens and two drafts (as `test_greedy.py`'s), for modules whose
    `target` is another model."""
    from tiny import perturbed_copy, tiny_lm

    target = tiny_lm(seed=0, vocab_size=64, layers=2, hidden=32, init_range=0.3)
    far = tiny_lm(seed=2, vocab_size=64, layers=1, hidden=32, init_range=0.3)
    return target, {"close": perturbed_copy(target, seed=1, scale=0.1), "far": far}


@pytest.fixture(scope="module")
def built():
    """The small-rows kernel, built (or loaded) once; tests that need it skip where it cannot be built here."""
    from hf_specsample.kernels import small_rows

    build = small_rows.load()
    if build.problem is not None:
        pytest.skip(build.problem)
    return build
