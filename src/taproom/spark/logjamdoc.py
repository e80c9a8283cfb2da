"""What a logjam request document holds, without Spark: the hub's console uses it too.

The resource lists follow the kinds logjam-tools' importer groups its configured resources
into; severities are numbered as logjam numbers them (Ruby's Logger).
"""

from __future__ import annotations

__all__ = [
    "LOGJAM_CALL_RESOURCES",
    "LOGJAM_FRONTEND_RESOURCES",
    "LOGJAM_MEMORY_RESOURCES",
    "LOGJAM_RESOURCES",
    "LOGJAM_TIME_RESOURCES",
    "SEVERITY_NAMES",
]

# The numeric resources of a logjam request that the request rollup sums (beside total_time),
# by the kinds logjam-tools' importer groups its configured resources into: time (ms), call
# (counts), memory and heap (objects, bytes), and the browser's page timings (ms). A request
# carries any subset; what it leaves out adds nothing. Resources outside this list are not summed.
LOGJAM_TIME_RESOURCES = (
    "view_time",
    "db_time",
    "api_time",
    "search_time",
    "memcache_time",
    "redis_time",
    "gc_time",
    "other_time",
)
LOGJAM_CALL_RESOURCES = ("db_calls", "api_calls", "search_calls", "memcache_calls", "redis_calls")
LOGJAM_MEMORY_RESOURCES = (
    "allocated_memory",
    "allocated_objects",
    "allocated_bytes",
    "heap_size",
    "live_data_set_size",
)
LOGJAM_FRONTEND_RESOURCES = (
    "page_time",
    "ajax_time",
    "connect_time",
    "request_time",
    "response_time",
    "processing_time",
    "load_time",
    "dom_interactive",
)
LOGJAM_RESOURCES = (
    *LOGJAM_TIME_RESOURCES,
    *LOGJAM_CALL_RESOURCES,
    *LOGJAM_MEMORY_RESOURCES,
    *LOGJAM_FRONTEND_RESOURCES,
)

# Logger severities as logjam numbers them (Ruby Logger: DEBUG 0 .. FATAL 4, UNKNOWN 5).
SEVERITY_NAMES = ("debug", "info", "warn", "error", "fatal", "unknown")
