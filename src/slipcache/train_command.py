"""`slipcache train`: one process, or one rank of N when torchrun started it.

The command chooses, so that neither package reaches up: `distributed` builds on `training`, and `training`
never imports `distributed`. The flags and the summary table are `training/cli.py`'s.
"""

from __future__ import annotations

import argparse
import sys

from slipcache.training.cli import add_train_arguments as add_train_arguments  # the command's flags
from slipcache.training.cli import format_summary
from slipcache.training.config import CONFIG_FIELDS, load_config_file, make_config

APPLIES_THREADS = True  # `train()` sets the run's threads itself: the CLI leaves them alone


def run_train(args: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(args).items() if k in CONFIG_FIELDS}
    file_values = load_config_file(args.config) if getattr(args, "config", None) else {}
    config = make_config(file_values, flags)
    from slipcache.distributed.launch import init_from_env

    context = init_from_env()  # None unless started by torchrun with more than one process
    if context is None:
        from slipcache.training.trainer import train

        summary = train(config)
    else:
        from slipcache.distributed.training import train_on_ranks

        summary = train_on_ranks(config, context)
        if not context.is_main:
            return 0
    print(f"finished: {summary['run_dir']}")  # its start printed `run: DIR` before training
    print(format_summary(summary))
    return 0


if __name__ == "__main__":  # python -m slipcache.train_command
    parser = argparse.ArgumentParser(prog="slipcache train")
    add_train_arguments(parser)
    from slipcache.console import console_messages

    with console_messages():
        code = run_train(parser.parse_args())
    sys.exit(code)
