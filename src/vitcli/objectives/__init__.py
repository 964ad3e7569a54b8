"""The objective as a part of the run (torchtitan's ModelSpec, big_vision's evaluators by name):
objective.py (what every objective gives the run: the network it trains, its loss per micro-batch,
its held-out evaluator, its head's width, its FLOPs, what it exports), one module per objective,
supervised.py, mpp.py (masked patch prediction), mae.py (masked autoencoders), dino.py (self-distillation:
DINO, DINOv2's terms), and registry.py,
where the recipe's `objective` picks one by name, once."""
