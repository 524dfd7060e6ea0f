import sys

from scripts.bench.harness import main

if __name__ == "__main__":  # (imported without running: the tests' console server)
    sys.exit(main())
