//! What writing a report produces and how that fails: the file names, [`Written`],
//! [`ReportError`], and the helpers that write a file, a PNG picture, and load the font.

use std::fs;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

/// File name of the JSON copy of the reports.
pub const JSON_FILE: &str = "report.json";
/// File name of the HTML page.
pub const HTML_FILE: &str = "index.html";

/// What [`write`] wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Written {
    /// Every file written, in the order written: `report.json` ([`write`] only), the
    /// charts, `index.html`.
    pub files: Vec<PathBuf>,
    /// Why no chart was written, when none was (for example: no load levels at all).
    pub charts_skipped: Option<String>,
}

/// Why writing or reading a report failed.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Creating, writing or reading a file or folder failed.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The reports could not be turned into JSON, or the file is not a JSON array of reports.
    #[error("{}: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// Drawing a chart failed.
    #[error("{}: drawing the chart failed: {message}", path.display())]
    Chart { path: PathBuf, message: String },
    /// Encoding a chart as PNG failed.
    #[error("{}: encoding the PNG failed: {source}", path.display())]
    Png {
        path: PathBuf,
        #[source]
        source: png::EncodingError,
    },
    /// The font built into the program could not be loaded (a build problem, not a data one).
    #[error("the built-in chart font could not be loaded")]
    Font,
}

pub(super) fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ReportError> {
    fs::write(path, bytes).map_err(|source| ReportError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Registers the built-in DejaVu Sans under plotters' generic family names, once.
pub(super) fn register_fonts() -> Result<(), ReportError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        ["sans-serif", "serif", "monospace"].iter().all(|family| {
            plotters::style::register_font(family, FontStyle::Normal, dejavu::sans::regular())
                .is_ok()
                && plotters::style::register_font(family, FontStyle::Bold, dejavu::sans::bold())
                    .is_ok()
        })
    });
    if ok { Ok(()) } else { Err(ReportError::Font) }
}

/// Draws a `size` picture with `draw` and writes it to `path` as PNG.
pub(super) fn write_png<E: std::fmt::Display>(
    path: &Path,
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<BitMapBackend<'_>, Shift>) -> Result<(), E>,
) -> Result<(), ReportError> {
    let (w, h) = size;
    let mut rgb = vec![0u8; w as usize * h as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
        draw(&root).map_err(|e| ReportError::Chart {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    }
    let file = fs::File::create(path).map_err(|source| ReportError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let png_err = |source| ReportError::Png {
        path: path.to_path_buf(),
        source,
    };
    let mut encoder = png::Encoder::new(BufWriter::new(file), w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(png_err)?;
    writer.write_image_data(&rgb).map_err(png_err)?;
    writer.finish().map_err(png_err)
}
