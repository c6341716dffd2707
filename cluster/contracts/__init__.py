"""What the driver and the actors both read: the only cluster/ modules that actors/ import (docs/design.md, Shape)."""
