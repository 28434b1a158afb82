"""`python server.py [--model PATH] [--host H] [--port P] ...`: the same as `deepinfer serve`."""

import sys

from deepinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
