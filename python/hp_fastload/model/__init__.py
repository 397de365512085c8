"""The model side: which tensors a checkpoint fills (targets, tied aliases), the global indices each rank holds of them
(local regions of DTensors on any mesh, virtual ranks), module wrappers, PEFT models under their checkpoints'
names, what a load finishes (ties, buffers) and named parallel layouts. Imports only ``source`` and the bottom
layers below it.
"""
