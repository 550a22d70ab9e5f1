from exporter.tools.cli import main
import sys
sys.exit(main())
