"""A SCAPE optimizer's run inside a Lightning loop: what the four strategies share, on Lightning Fabric alone.

The run itself is one object, :class:`~lightning_scape.runtime.scape_runtime.ScapeRuntime` (set-up objects,
clipping, failure, notices, the end of a run); the DDP and FSDP forms differ only in how the engine holds the
parameters (:mod:`~lightning_scape.runtime.parameter_holding`) and in their checkpoint format. The Fabric strategies
(:mod:`lightning_scape.fabric`) and the Trainer's (:mod:`lightning_scape.pytorch`) translate Lightning's hooks into
its calls. Nothing here imports ``lightning.pytorch``. One module per concern:

* :mod:`~lightning_scape.runtime.scape_runtime`: the runtime, and the names the strategies' users call;
* :mod:`~lightning_scape.runtime.parameter_holding`: replicated (DDP forms) or FSDP-sharded (FSDP forms) parameters;
* :mod:`~lightning_scape.runtime.options`: the SCAPE options a strategy accepts and the process-group timeout;
* :mod:`~lightning_scape.runtime.optimizer`: AdamW/Adam to AdamS, and the :class:`ScapeOptimizer` handed back;
* :mod:`~lightning_scape.runtime.lr_notices`: what a converted optimizer is told about its learning rate;
* :mod:`~lightning_scape.runtime.engine_setup`: rank 0's weights everywhere, the engine, its log line;
* :mod:`~lightning_scape.runtime.loss_scaling`: fp16 loss scaling;
* :mod:`~lightning_scape.runtime.warmup_notice`: a schedule that does not fit the run, told once;
* :mod:`~lightning_scape.runtime.setup_checks`: low-precision weights refused, a single process named;
* :mod:`~lightning_scape.runtime.local_grads`: what is said to code that reads ``param.grad`` as DDP's average;
* :mod:`~lightning_scape.runtime.checkpoint_protocol`: the checkpoint protocol (main file, per-rank SCAPE files);
* :mod:`~lightning_scape.runtime.registry`: the names ``"scape"``, ``"scape_spawn"`` and ``"scape_fsdp"``, and what each
  builds;
* :mod:`~lightning_scape.runtime.fsdp`: ``ScapeFSDPStrategy``'s optimizer over FSDP2's shards (the grid, the sharding
  and the binding themselves are torch only: :mod:`lightning_scape.engine.fsdp_binding`);
* :mod:`~lightning_scape.runtime.fsdp_checkpoint`: its checkpoint folders (one file per rank and ``meta.pt``).

Below it, without Lightning: :mod:`lightning_scape.comm.rank_failures` (a failure on any rank agreed on and reported
once, by rank 0), :mod:`lightning_scape.planning.run_traffic` (the bytes a whole run sends, SCAPE's and DDP's) and
:mod:`lightning_scape.planning.run_summary` (what a run did, said at its end).
"""
