"""What a SCAPE strategy says about its run, the same under the four strategies: the schedule's notice before a
run whose length is known (:meth:`RunNotices.warn_if_all_dense`), and at the end of a run that did not fail, the
notice of one that never left its dense steps and the run's summary."""

from __future__ import annotations

from lightning_scape.config import ScapeConfig
from lightning_scape.runtime import engine_setup
from lightning_scape.runtime.run_summary import RunSummary
from lightning_scape.runtime.warmup_notice import Syntax, WarmupNotice, call_at_exit


class RunNotices(RunSummary):
    """The notices and the end-of-run summary of a SCAPE strategy (a mixin of the four).

    A strategy sets ``_failed`` when its run fails (then nothing is said at the end: the failure is), and defines
    :meth:`_scape_ranks`.
    """

    scape_config: ScapeConfig
    _failed = False
    _planned: tuple[float | None, Syntax] | None = None  # steps and syntax, until an engine gives the layout
    _notice: WarmupNotice | None = None
    _end_registered_at_exit = False

    def _scape_ranks(self) -> int | None:
        """The ranks SCAPE runs across (the processes; the groups of the FSDP form), None until known."""
        raise NotImplementedError

    @property
    def _schedule_notice(self) -> WarmupNotice:
        if self._notice is None:
            self._notice = WarmupNotice(type(self).__name__)
        return self._notice

    def warn_if_all_dense(self, planned_steps: float | None, syntax: Syntax = "python") -> None:
        """Warn once, on rank 0, if the run's steps would all be sent dense (a ``DenseWarmupWarning``), or would end
        inside the density ramp or send more than a quarter of DDP's bytes (then with a schedule scaled to the run).

        The Trainer's strategies call it before the first training batch with ``estimated_stepping_batches``.
        Fabric does not know how long a run will be, so without this call a run that never left its dense steps is
        told at its end: a training loop that knows its length (``lightning-scape pretrain``) calls it before the
        first step, while the schedule can still be changed. Called before the optimizer is set up, the bytes are
        computed (and the warning given) once it is.

        Args:
            planned_steps: The optimizer steps the run will take; None or inf when not known (then nothing is
                said now).
            syntax: How the message writes the settings: ``"python"`` (``ScapeStrategy(...)``) or ``"cli"``
                (``--scape.dense_warmup_steps N``, the ``pretrain`` command's flags).
        """
        self._planned = (planned_steps, syntax)
        self._check_schedule()

    def _check_schedule(self) -> None:
        """The notice of :meth:`warn_if_all_dense`, once an engine gives the layout (an all-dense run: at once)."""
        if self._planned is None:
            return
        planned, syntax = self._planned
        opts = self.scape_optimizers
        layout = [bs.layout for bs in opts[-1].engine.buckets] if opts else None
        if layout is None and planned is not None and planned > self.scape_config.dense_steps:
            return  # wait for the layout (the optimizer's set-up calls this again)
        self._schedule_notice.before_run(self.scape_config, planned, layout, self._scape_ranks(), syntax)
        self._planned = None

    def _start_run_notices(self) -> None:
        """A new run (a Trainer's next fit) may be told again, and is summed up at its end."""
        self._notice = None
        self._planned = None
        self._summary_given = False

    def _end_at_exit(self) -> None:
        """Have :meth:`_end_of_run` called when the process exits (Fabric does not tear its strategy down)."""
        if not self._end_registered_at_exit:
            call_at_exit(self._end_of_run)
            self._end_registered_at_exit = True

    def _close_run(self) -> None:
        """At teardown: close the engines (waiting on no collective after a failure; the heartbeat stops), then
        :meth:`_end_of_run`."""
        # Closed first: the wait for the last mask's all-gather, still in flight, belongs in the summary.
        engine_setup.close_engines(self.scape_optimizers, wait=not self._failed)
        self._end_of_run()  # a run whose length was not known at the start (early stopping, ...) is told now

    def _end_of_run(self) -> None:
        """Unless the run failed: warn if it never left its dense steps, and log its summary (rank 0, once)."""
        if self._failed or any(opt.engine.wire.failed for opt in self.scape_optimizers):
            return
        for opt in self.scape_optimizers:
            self._schedule_notice.after_run(opt.engine, self._scape_ranks())
        self._log_run_summary()
