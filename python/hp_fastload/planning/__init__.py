"""Planning: checkpoint headers + rules (or a state-dict adapter) + model layout -> a rank's read items, through one
entry (``front.plan`` with a ``request.PlanRequest``); also the released layout a save writes (``export``), the
job-wide plan (``jobneeds``, ``jobranks``, ``jobwide``, ``jobcost``, ``simulate``) and the transfer plan
(``transfer``). Never touches tensor bytes and never talks to other ranks.
"""
