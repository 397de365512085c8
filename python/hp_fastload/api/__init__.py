"""The user-facing calls: ``load``, ``plan``, ``save``, ``from_pretrained``, ``read_many``/``read_into``,
``HuggingFaceCheckpointer`` and the DCP readers. The top library layer; ``hp_fastload`` re-exports its public names.
"""
