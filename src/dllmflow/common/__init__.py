"""Bottom-layer helpers every stage may import (stdlib only, no torch): atomic files, a free port."""
