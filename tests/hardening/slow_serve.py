"""``python slow_serve.py SECONDS serve ARTIFACTS ...``: ``kvserve serve`` whose every decode step
first sleeps SECONDS (a slow model: the shutdown tests need generations that outlast a grace
period on any machine). Everything else is the real entry point."""
import sys
import time

from kvserve import cli
from kvserve.artifact.fused import FusedLM
from kvserve.artifact.portable import PortableLM

DELAY = float(sys.argv[1])


def _slowed(decode):
    def slow_decode(self, *a, **kw):
        time.sleep(DELAY)
        return decode(self, *a, **kw)
    return slow_decode


for runner in (FusedLM, PortableLM):  # every model step: decode, and speculation's verify
    runner.decode = _slowed(runner.decode)
    runner.verify = _slowed(runner.verify)

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[2:]))
