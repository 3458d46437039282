"""The end-to-end demo: ``trainmon demo`` (see run.py) and its training job (train.py)."""


def main(argv=None):
    from .run import main as run

    return run(argv)
