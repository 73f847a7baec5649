"""The training script of one ``fdl bench`` cell: a zoo model on a bench dataset, trained by
``fdl.Trainer`` in every worker that ``fdl run`` starts::

    fdl run --nproc-per-node 2 --policy cadence --backend cpu --simulate-slowdown 1,2.5 \\
        --epochs 1 --seed 0 -m fdl.bench.train_cell -- --model mlp --dataset digits \\
        --data-dir ~/.flodl/datasets

Epochs, seed, batch size, policy, backend and slowdown are ``fdl run``'s flags (they override
the values passed to the Trainer here); the model's own table supplies the optimizer, the LR,
the schedule and the per-worker batch size, identical in every mode. The dataset must already
be on disk (``download=False``): the sweep fetches and verifies it once, before the first cell,
so that N workers never race to download the same file.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from pathlib import Path

from fdl.bench.datasets import load_dataset
from fdl.bench.models import get_model
from fdl.engine.trainer import Trainer


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fdl.bench.train_cell",
                                     description="Train one fdl bench cell (run under fdl run).")
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--seq-len", type=int, default=128,
                        help="window length for the character datasets")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    model = get_model(args.model)
    splits = load_dataset(args.dataset, data_dir=args.data_dir, download=False,
                          seq_len=args.seq_len)
    Trainer(
        model=functools.partial(model.build, splits.meta),
        optimizer=model.make_optimizer,
        train_step=model.train_step,
        train_data=splits.train,
        eval_data=splits.test,
        evaluate=model.evaluate,
        schedule=model.schedule,
        batch_size=model.batch_size,
        epochs=model.epochs,
    ).fit()


if __name__ == "__main__":
    main()
