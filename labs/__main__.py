import gc
import sys

gc.disable()    # as in labs.rank: importing torch makes many objects and next to no garbage, a wasted pass for the collector

from labs.cli import main  # noqa: E402  (after the collector is off)

gc.freeze()
gc.enable()
sys.exit(main())
