"""The user-facing calls: ``load``, ``plan``, ``save``, ``from_pretrained``, ``load_adapter``, ``rehearse`` /
``plan_each``, ``read_many`` / ``read_into``, ``HuggingFaceCheckpointer``, the DCP readers and the framework
integrations, with the API edge of planning (``request``: the arguments resolved once into a ``PlanRequest``). The
top library layer; ``hp_fastload`` re-exports its public names.
"""
