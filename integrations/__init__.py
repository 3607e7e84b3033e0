"""Integrations of the checkpointer with training frameworks.

* :mod:`ckpt.integrations.lightning`: a Lightning ``Callback`` and ``CheckpointIO`` plugin.
* :mod:`ckpt.integrations.hf`: a Hugging Face ``Trainer`` callback that snapshots through the tiers and resumes exactly.
* :mod:`ckpt.integrations.signals`: re-exports :mod:`ckpt.preempt` (signals turned into durable saves).
* :mod:`ckpt.integrations.dcp`: ``torch.distributed.checkpoint`` storage over the tiers, without pickle.
"""

__all__: list[str] = []
