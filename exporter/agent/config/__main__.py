"""`python -m exporter.agent.config --markdown`: print docs/configuration.md."""

import sys

from exporter.agent.config.docs import main

sys.exit(main())
