"""``python slow_serve.py SECONDS serve ARTIFACTS ...``: ``kvserve serve`` whose every decode step
first sleeps SECONDS (a slow model: the shutdown tests need generations that outlast a grace
period on any machine). Everything else is the real entry point."""
import sys
import time

from kvserve import cli
from kvserve.server import runtime

DELAY = float(sys.argv[1])
_decode = runtime.OnnxLM.decode


def _slow_decode(self, *a, **kw):
    time.sleep(DELAY)
    return _decode(self, *a, **kw)


runtime.OnnxLM.decode = _slow_decode

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[2:]))
