"""Planning: checkpoint headers + rules + model layout -> one rank's read items. Never touches tensor bytes."""
