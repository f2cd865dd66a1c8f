"""The completions wing: ``aiostream.wait()`` of other libraries' handles (``waits``: one
poller per event loop, callbacks hopped to the loop) and how each kind of handle says it is
done (``adapters``). It builds on the core and is imported by nothing of it; the public names
are ``aiostream``'s own (``aiostream.wait``, ``aiostream.Adapter``, ...)."""
