"""The run, built once below the stages (torchtitan's train.py and Trainer.__init__): report.py (a
finished run's table; how the stages' tables write a number), feed.py (the train micro-batches, and
every label checked against the head), network.py (the network and its objective), trial.py (a
micro-batch's steps in a process of its own, and their peak memory), micro_batch.py
(data.micro_batch_size auto: the largest that fits, found by trials), build.py (the builder: decide,
build_job, start, finish), measure.py (--preflight's short run, timed), estimate.py (the whole run's
figures from it)."""
