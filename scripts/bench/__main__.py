import sys

from scripts.bench.harness import main

sys.exit(main())
