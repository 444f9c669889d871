"""``npuw-kv serve --ray``: several npuw-kv servers, on one machine or many, behind one
OpenAI endpoint on Ray Serve, with requests routed to the replica that already holds their
prompt's prefix.  Everything here but :mod:`.affinity`, :mod:`.forward` and
:mod:`.metrics_merge` needs the ``ray`` extra."""
