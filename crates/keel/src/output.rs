//! Where command output goes: human text or versioned JSON on stdout.

use std::io::{self, Write};

use serde::Serialize;

/// The version of every JSON document keel prints. Bumped on any change
/// that removes or renames a field; adding a field keeps it.
pub const JSON_VERSION: u32 = 1;

pub struct Out {
    pub json: bool,
    w: Box<dyn Write>,
}

impl Out {
    pub fn stdout(json: bool) -> Self {
        Self {
            json,
            w: Box::new(io::stdout().lock()),
        }
    }

    /// Writes `{"version": 1, "command": ..., <body fields>}`.
    pub fn json<T: Serialize>(&mut self, command: &str, body: &T) -> anyhow::Result<()> {
        let mut value = serde_json::to_value(body)?;
        let mut doc = serde_json::Map::new();
        doc.insert("version".into(), JSON_VERSION.into());
        doc.insert("command".into(), command.into());
        match value.take() {
            serde_json::Value::Object(fields) => doc.extend(fields),
            other => {
                doc.insert("result".into(), other);
            }
        }
        serde_json::to_writer_pretty(&mut self.w, &doc)?;
        writeln!(self.w)?;
        self.w.flush()?;
        Ok(())
    }

    pub fn text(&mut self, s: &str) -> anyhow::Result<()> {
        self.w.write_all(s.as_bytes())?;
        self.w.flush()?;
        Ok(())
    }
}

#[cfg(test)]
impl Out {
    /// JSON output into a buffer the caller reads back (tests).
    pub fn buffer() -> (Out, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
        struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl Write for Shared {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                self.0
                    .lock()
                    .map_err(|_| io::Error::other("poisoned"))?
                    .extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        (
            Out {
                json: true,
                w: Box::new(Shared(buf.clone())),
            },
            buf,
        )
    }
}
