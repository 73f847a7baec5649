"""fdl.Trainer on the common task, made unstable halfway through the run: from there the loss
is scaled by FACTOR (as a loss-scaling mistake or an exploding gradient would scale it), so
every SGD step is FACTOR times too long and the replicas, on different batches, blow apart
between averages, while the learning rate the guard normalises by stays the same. The tanh
layer saturates instead of overflowing: the drift stays large and finite to the end.
Settings come from fdl run. Usage: divergence_train.py NUM_SAMPLES FACTOR"""

import sys

from common import build_model, build_optimizer, make_data, train_step

import fdl

num_samples, factor = int(sys.argv[1]), float(sys.argv[2])
scale = [1.0]


def schedule(progress: float) -> float:
    """Called before every step with the run's progress: sets the loss scale, leaves the
    learning rate alone."""
    scale[0] = 1.0 if progress < 0.5 else factor
    return 1.0


fdl.Trainer(
    model=build_model, optimizer=build_optimizer,
    train_step=lambda model, batch: scale[0] * train_step(model, batch),
    train_data=make_data(num_samples, seed=1), batch_size=32, epochs=2, policy="cadence",
    seed=7, schedule=schedule,
).fit()
