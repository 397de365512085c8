"""Execution: plans become engine batches (``_core.execute``), in either direction. Owns the item records and
batches, staging (pinned host slabs for device targets), reads into local shards (``read``), writes of export
regions (``write``), the job-wide plan of a load agreed and delivered rank to rank (``job``, ``deliver``), the
transfer between live models (``transfer``) and the engine's thread count. Runs what ``planning`` decided and
calls ``dist`` for the agreements; decides nothing itself.
"""
