"""The data wing: host and device buffers and their copies (``buffers``), DLPack export and
import (``_dlpack``), and the data loader (``loader``, its staging and batches in
``_staging``). It builds on the core and is imported by nothing of it; the public names are
``aiostream``'s own (``aiostream.DataLoader``, ``aiostream.HostBuffer``, ...)."""
