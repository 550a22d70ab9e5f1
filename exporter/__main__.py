from exporter.cli import main
import sys
sys.exit(main())
