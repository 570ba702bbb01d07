//! Wall-clock time, injected: quotas reset on calendar boundaries and the
//! audit and access logs stamp entries, but the library never reads the
//! clock itself. The clock and the calendar are keel-time's.

pub use keel_time::{
    day_end_ms, day_of, month_end_ms, month_of, rfc3339, Clock, ManualClock, Stamp,
};
