"""Test helpers shipped with the package, so that third-party backends can reuse them."""
