"""Observability: model FLOPs and MFU (``flops``), the step timeline (``trace``), TensorBoard scalars
(``tensorboard``), plots of a run (``report``) and the sync audit (``syncs``). Generic: nothing here imports a
model family."""
