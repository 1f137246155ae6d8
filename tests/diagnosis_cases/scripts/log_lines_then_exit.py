# A script that logs to stderr (Python's logging: INFO lines, one says "got 15") and stops with a
# bare exit status: nothing names a cause.
import logging
import sys

logging.basicConfig(level=logging.INFO)
logging.info("got 15 batches from the loader")
logging.info("received SIGNALS config from the server")
sys.exit(3)
