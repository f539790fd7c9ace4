"""Suite-wide: no test app shares the persistent result store (app/store.py) with another test or with a
previous run; tests of the store name their own folder or Redis server explicitly."""

import os

os.environ["QKOV_STORE_URL"] = "off"
