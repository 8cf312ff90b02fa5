"""The demo's parts (``python -m tilescale_examples.demo`` is the command line,
:mod:`tilescale_examples.demo`):

* :mod:`.cases`: what the demo runs: the cases, each built through the examples' public
  constructors with its torch.distributed baseline, and the heap they need;
* :mod:`.ranks`: the rank bodies: compile mode (no GPU) and GPU mode (check, then time), and
  the logging and kernel counting around them.
"""
