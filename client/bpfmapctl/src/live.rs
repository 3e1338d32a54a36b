//! The full-screen live table of `top --interval`: a [`Snapshot`] of the
//! fleet drawn as a table, redrawn whenever a new one arrives, with keys to
//! change the sort column, its direction, the row limit, and to pause.
//!
//! The data come from elsewhere: whoever scans the fleet sends a
//! [`Snapshot`] per scan on a [`tokio::sync::watch`] channel, and [`run`]
//! shows the newest one until the user quits. [`draw`] and [`on_key`] are
//! the view and the key handling on their own, without a terminal, for the
//! tests.
//!
//! [`run`] owns the terminal: raw mode and the alternate screen while it
//! runs, both undone when it returns, fails, is dropped (a cancelled future)
//! or when a panic happens meanwhile (a panic hook restores the terminal
//! before the panic is reported, and the previous hook is put back when
//! `run` ends).

use std::{
    cmp::Ordering,
    io::{self, IsTerminal as _},
    panic::{self, PanicHookInfo},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering as AtomicOrdering},
    },
    thread,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use ratatui::{
    Frame, Terminal,
    backend::CrosstermBackend,
    crossterm::{
        self,
        event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers},
        terminal::{EnterAlternateScreen, LeaveAlternateScreen},
    },
    layout::{Constraint, Layout, Rect},
    style::{Color, Modifier, Style},
    text::{Line, Span},
    widgets::{self, Paragraph, Table},
};
use tokio::sync::{mpsc, watch};

/// One row of the table: a group (or an entry) with its cells.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Row {
    /// The typed key as shown: "192.168.0.1", "daddr=192.168.0.1 dport=443".
    pub(crate) key: String,
    /// One cell per column of [`Snapshot::headers`], in that order.
    pub(crate) cells: Vec<Cell>,
    /// Recent values of the sort column's rate, oldest first: the row's
    /// sparkline (scaled to its own largest value).
    pub(crate) history: Vec<u64>,
}

/// One cell: what it shows and what it sorts by.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Cell {
    /// Formatted: "18.0 MB/s", "1,234".
    pub(crate) text: String,
    /// The value the rows are sorted by when this column is the sort column
    /// (NaN sorts last in either direction).
    pub(crate) sort: f64,
}

/// What one refresh shows.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Snapshot {
    /// The first line: "demo/flows by rate(sum(value.bytes)) per key.daddr".
    pub(crate) title: String,
    /// The header of the key column ("key.daddr").
    pub(crate) key_header: String,
    /// The headers of the value columns; [`ViewState::sort`] indexes them.
    pub(crate) headers: Vec<String>,
    /// In any order: [`draw`] sorts them.
    pub(crate) rows: Vec<Row>,
    /// The targets that answered the last scan.
    pub(crate) hosts_ok: usize,
    /// The targets asked.
    pub(crate) hosts_total: usize,
    /// Each target that did not answer, and why ("connection refused").
    pub(crate) failing: Vec<(String, String)>,
    /// When the last scan ended; `None` before the first.
    pub(crate) scan_time: Option<SystemTime>,
    /// The time between scans.
    pub(crate) interval: Duration,
}

/// The view's state, which the keys change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ViewState {
    /// The sort column: an index into [`Snapshot::headers`].
    pub(crate) sort: usize,
    /// Smallest first; largest first when false.
    pub(crate) ascending: bool,
    /// At most this many rows (`-n`; 0: every row). The screen's height
    /// cuts them too.
    pub(crate) limit: usize,
    /// While paused the view keeps the snapshot it shows and ignores new
    /// ones; resuming shows the newest.
    pub(crate) paused: bool,
}

/// What a key asks of the live view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// Nothing changed.
    None,
    /// Leave the live view.
    Quit,
    /// The [`ViewState`] changed: redraw.
    Changed,
}

/// The most characters a sparkline takes.
const SPARK_MAX: usize = 32;
/// The header of the sparkline column.
const SPARK_HEADER: &str = "trend";
/// The key column is cut to this width.
const KEY_MAX: u16 = 48;
/// Blank columns between two columns of the table.
const SPACING: u16 = 2;
/// At most this many failing targets are named on the status line.
const FAILING_SHOWN: usize = 2;
/// The eighths of a block, lowest first.
const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

/// Draws `snap` over the whole frame: a title line, the table and a status
/// line.
///
/// The table has the key column, one column per header and a sparkline of
/// each row's history; its rows are sorted by the `view.sort` column
/// (largest first unless `view.ascending`, ties by key), at most
/// `view.limit` of them (0: all) and as many as fit. The sort column's
/// header carries "▼" (largest first) or "▲". The status line reads "3/4
/// hosts answering · 10.0.0.7: connection refused · last scan 14:02:03 UTC
/// · every 1s · s/←/→ sort · r reverse · +/- rows · p pause · q quit".
pub(crate) fn draw(frame: &mut Frame<'_>, snap: &Snapshot, view: &ViewState) {
    let [title_area, table_area, status_area] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Min(0),
        Constraint::Length(1),
    ])
    .areas(frame.area());

    let rows = visible_rows(snap, view);
    let fits = usize::from(table_area.height.saturating_sub(1));
    let shown = rows.len().min(fits);

    let mut title = vec![
        Span::styled(
            snap.title.clone(),
            Style::new().add_modifier(Modifier::BOLD),
        ),
        Span::raw(format!(" · {shown} of {} rows", snap.rows.len())),
    ];
    if view.paused {
        title.push(Span::styled(
            " · paused",
            Style::new().fg(Color::Yellow).add_modifier(Modifier::BOLD),
        ));
    }
    frame.render_widget(Paragraph::new(Line::from(title)), title_area);
    frame.render_widget(table(snap, view, &rows[..shown], table_area), table_area);
    frame.render_widget(Paragraph::new(status_line(snap, view)), status_area);
}

/// The rows of `snap` in the order `view` sorts them, cut to its limit.
fn visible_rows<'a>(snap: &'a Snapshot, view: &ViewState) -> Vec<&'a Row> {
    let mut rows: Vec<&Row> = snap.rows.iter().collect();
    if view.sort < snap.headers.len() {
        let value = |r: &Row| r.cells.get(view.sort).map_or(f64::NAN, |c| c.sort);
        rows.sort_by(|a, b| {
            let (x, y) = (value(a), value(b));
            let by_value = match (x.is_nan(), y.is_nan()) {
                (true, true) => Ordering::Equal,
                (true, false) => Ordering::Greater,
                (false, true) => Ordering::Less,
                (false, false) if view.ascending => x.total_cmp(&y),
                (false, false) => y.total_cmp(&x),
            };
            by_value.then_with(|| a.key.cmp(&b.key))
        });
    }
    if view.limit != 0 {
        rows.truncate(view.limit);
    }
    rows
}

/// The table of `rows` (already sorted and cut) for `area`.
fn table<'a>(snap: &'a Snapshot, view: &ViewState, rows: &[&'a Row], area: Rect) -> Table<'a> {
    let marker = if view.ascending { "▲" } else { "▼" };
    let headers: Vec<String> = snap
        .headers
        .iter()
        .enumerate()
        .map(|(i, h)| {
            if i == view.sort {
                format!("{h} {marker}")
            } else {
                h.clone()
            }
        })
        .collect();

    let key_width = rows
        .iter()
        .map(|r| width(&r.key))
        .chain([width(&snap.key_header)])
        .max()
        .unwrap_or(0)
        .min(KEY_MAX);
    let value_widths: Vec<u16> = headers
        .iter()
        .enumerate()
        .map(|(i, h)| {
            rows.iter()
                .filter_map(|r| r.cells.get(i))
                .map(|c| width(&c.text))
                .chain([width(h)])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let used = value_widths.iter().fold(key_width, |sum, w| {
        sum.saturating_add(SPACING).saturating_add(*w)
    });
    let longest = rows.iter().map(|r| r.history.len()).max().unwrap_or(0);
    let room = usize::from(area.width.saturating_sub(used.saturating_add(SPACING)));
    let spark_width = longest.clamp(SPARK_HEADER.len(), SPARK_MAX).min(room);
    let sparks = longest > 0 && spark_width >= SPARK_HEADER.len();

    let mut widths = vec![Constraint::Length(key_width)];
    widths.extend(value_widths.iter().map(|w| Constraint::Length(*w)));
    let mut header = vec![widgets::Cell::from(snap.key_header.as_str())];
    header.extend(headers.into_iter().enumerate().map(|(i, h)| {
        let style = if i == view.sort {
            Style::new().add_modifier(Modifier::UNDERLINED)
        } else {
            Style::new()
        };
        widgets::Cell::from(Line::from(h).right_aligned()).style(style)
    }));
    if sparks {
        widths.push(Constraint::Length(u16::try_from(spark_width).unwrap_or(0)));
        header.push(widgets::Cell::from(SPARK_HEADER));
    }

    let body = rows.iter().map(|r| {
        let mut cells = vec![widgets::Cell::from(r.key.as_str())];
        cells.extend((0..snap.headers.len()).map(|i| {
            let text = r.cells.get(i).map_or("", |c| c.text.as_str());
            widgets::Cell::from(Line::from(text).right_aligned())
        }));
        if sparks {
            cells.push(
                widgets::Cell::from(sparkline(&r.history, spark_width))
                    .style(Style::new().fg(Color::Cyan)),
            );
        }
        widgets::Row::new(cells)
    });
    Table::new(body, widths)
        .header(widgets::Row::new(header).style(Style::new().add_modifier(Modifier::BOLD)))
        .column_spacing(SPACING)
}

/// The status line: the targets answering, those failing, the last scan,
/// the interval (or "paused") and the keys.
fn status_line(snap: &Snapshot, view: &ViewState) -> Line<'static> {
    let sep = || Span::raw(" · ");
    let hosts_style = if snap.hosts_ok == snap.hosts_total {
        Style::new().fg(Color::Green)
    } else {
        Style::new().fg(Color::Yellow)
    };
    let mut spans = vec![Span::styled(
        format!("{}/{} hosts answering", snap.hosts_ok, snap.hosts_total),
        hosts_style,
    )];
    for (host, why) in snap.failing.iter().take(FAILING_SHOWN) {
        spans.push(sep());
        spans.push(Span::styled(
            format!("{host}: {why}"),
            Style::new().fg(Color::Red),
        ));
    }
    if snap.failing.len() > FAILING_SHOWN {
        spans.push(sep());
        spans.push(Span::styled(
            format!("{} more failing", snap.failing.len() - FAILING_SHOWN),
            Style::new().fg(Color::Red),
        ));
    }
    spans.push(sep());
    spans.push(Span::raw(match snap.scan_time {
        Some(t) => format!("last scan {}", clock(t)),
        None => "no scan yet".to_owned(),
    }));
    spans.push(sep());
    spans.push(if view.paused {
        Span::styled("paused", Style::new().fg(Color::Yellow))
    } else {
        Span::raw(format!("every {}", interval(snap.interval)))
    });
    let pause = if view.paused { "p resume" } else { "p pause" };
    spans.push(Span::styled(
        format!(" · s/←/→ sort · r reverse · +/- rows · {pause} · q quit"),
        Style::new().add_modifier(Modifier::DIM),
    ));
    Line::from(spans)
}

/// `t` as "HH:MM:SS UTC" (the time of day, in UTC: no time zone data is
/// read).
fn clock(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) % 86_400;
    format!(
        "{:02}:{:02}:{:02} UTC",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// `d` as "1s", "2m", "500ms" or "1.5s".
fn interval(d: Duration) -> String {
    let ms = d.as_millis();
    if !ms.is_multiple_of(1000) {
        if ms < 1000 {
            format!("{ms}ms")
        } else {
            format!("{:.1}s", d.as_secs_f64())
        }
    } else if ms >= 60_000 && ms.is_multiple_of(60_000) {
        format!("{}m", ms / 60_000)
    } else {
        format!("{}s", ms / 1000)
    }
}

/// The display width of `s`, in columns.
fn width(s: &str) -> u16 {
    u16::try_from(Span::raw(s).width()).unwrap_or(u16::MAX)
}

/// What `key` does to `view`, with `columns` value columns to sort by:
///
/// - `q`, Esc, Ctrl-C: [`Action::Quit`];
/// - `s` or →: the next sort column, ← or `S` the previous (both wrap
///   around);
/// - `r`: reverse the order;
/// - `p`: pause or resume;
/// - `+` (or `=`) and `-`: one row more or fewer (never fewer than one; a
///   limit of 0, every row, is left as it is).
///
/// Key releases and other keys are [`Action::None`].
pub(crate) fn on_key(key: KeyEvent, view: &mut ViewState, columns: usize) -> Action {
    if key.kind == KeyEventKind::Release {
        return Action::None;
    }
    let sort = |view: &mut ViewState, next: fn(usize, usize) -> usize| {
        if columns == 0 {
            return Action::None;
        }
        let from = view.sort.min(columns - 1);
        let to = next(from, columns);
        if to == view.sort {
            return Action::None;
        }
        view.sort = to;
        Action::Changed
    };
    match key.code {
        KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => Action::Quit,
        KeyCode::Char('q' | 'Q') | KeyCode::Esc => Action::Quit,
        KeyCode::Char('s') | KeyCode::Right => sort(view, |i, n| (i + 1) % n),
        KeyCode::Char('S') | KeyCode::Left => sort(view, |i, n| (i + n - 1) % n),
        KeyCode::Char('r') => {
            view.ascending = !view.ascending;
            Action::Changed
        }
        KeyCode::Char('p') => {
            view.paused = !view.paused;
            Action::Changed
        }
        KeyCode::Char('+' | '=') if view.limit != 0 => {
            view.limit = view.limit.saturating_add(1);
            Action::Changed
        }
        KeyCode::Char('-') if view.limit > 1 => {
            view.limit -= 1;
            Action::Changed
        }
        _ => Action::None,
    }
}

/// `v` per second with an SI prefix and one decimal: (18e6, "B/s") is
/// "18.0 MB/s", (1234, "/s") "1.2k/s", (0.5, "/s") "0.5/s". A `unit` that
/// starts with a letter is set apart by a space. NaN and infinities are
/// "-".
pub(crate) fn human_rate(v: f64, unit: &str) -> String {
    if !v.is_finite() {
        return "-".to_owned();
    }
    const PREFIXES: [&str; 7] = ["", "k", "M", "G", "T", "P", "E"];
    let mut scaled = v;
    let mut prefix = 0;
    // 999.95 would print as "1000.0": the next prefix shows it as "1.0".
    while scaled.abs() >= 999.95 && prefix + 1 < PREFIXES.len() {
        scaled /= 1000.0;
        prefix += 1;
    }
    let space = if unit.starts_with(char::is_alphanumeric) {
        " "
    } else {
        ""
    };
    format!("{scaled:.1}{space}{}{unit}", PREFIXES[prefix])
}

/// The last `width` values of `history` as block characters ▁▂▃▄▅▆▇█,
/// scaled so that their largest is █ (all ▁ when every one is 0), newest on
/// the right; spaces on the left when there are fewer than `width`. Always
/// `width` characters.
pub(crate) fn sparkline(history: &[u64], width: usize) -> String {
    let recent = &history[history.len().saturating_sub(width)..];
    let max = recent.iter().copied().max().unwrap_or(0);
    let mut out: String = " ".repeat(width - recent.len());
    out.extend(recent.iter().map(|&v| {
        let level = if max == 0 {
            0
        } else {
            // Rounded to the nearest eighth; u128 so that v * 7 cannot
            // overflow.
            (u128::from(v) * 7 + u128::from(max) / 2) / u128::from(max)
        };
        BARS[usize::try_from(level).unwrap_or(7).min(7)]
    }));
    out
}

/// What the key reader thread sends.
#[derive(Debug)]
enum Input {
    Key(KeyEvent),
    /// The terminal's size changed: redraw.
    Resize,
    /// Reading the terminal failed.
    Failed(io::Error),
}

/// Runs the live view until the user quits: the terminal in raw mode on the
/// alternate screen (both restored when `run` ends in any way, and by a
/// panic meanwhile), `view` drawn over the newest [`Snapshot`] of `updates`
/// at once and whenever a new one arrives, keys read by a thread of their
/// own (see [`on_key`]). When the sender is dropped the last snapshot stays
/// on the screen until the user quits.
///
/// Fails at once when stdout is not a terminal, and when drawing or reading
/// the terminal fails.
pub(crate) async fn run(updates: watch::Receiver<Snapshot>, view: ViewState) -> io::Result<()> {
    if !io::stdout().is_terminal() {
        return Err(io::Error::other("the live view needs a terminal on stdout"));
    }
    let mut screen = Screen::enter()?;
    let mut terminal = Terminal::new(CrosstermBackend::new(io::stdout()))?;
    let (keys_tx, keys) = mpsc::channel(16);
    let reader = thread::Builder::new()
        .name("bpfmapctl-keys".to_owned())
        .spawn(move || read_keys(&keys_tx))?;
    let result = live(updates, view, keys, |snap, view| {
        terminal.draw(|frame| draw(frame, snap, view)).map(drop)
    })
    .await;
    // `live` dropped the receiver: the reader sees it within a poll.
    let joined = tokio::task::spawn_blocking(move || reader.join()).await;
    let restored = screen.leave();
    result?;
    restored?;
    if !matches!(joined, Ok(Ok(()))) {
        return Err(io::Error::other("the key reader failed"));
    }
    Ok(())
}

/// The loop of [`run`] without the terminal: draws with `redraw`, reads
/// [`Input`]s from `keys`, until a key quits or `keys` closes.
async fn live(
    mut updates: watch::Receiver<Snapshot>,
    mut view: ViewState,
    mut keys: mpsc::Receiver<Input>,
    mut redraw: impl FnMut(&Snapshot, &ViewState) -> io::Result<()>,
) -> io::Result<()> {
    let mut shown = updates.borrow_and_update().clone();
    let mut feed = true;
    redraw(&shown, &view)?;
    loop {
        tokio::select! {
            changed = updates.changed(), if feed => {
                if changed.is_err() {
                    // The sender is gone: keep what is shown.
                    feed = false;
                    continue;
                }
                if view.paused {
                    updates.mark_unchanged();
                    continue;
                }
                shown = updates.borrow_and_update().clone();
            }
            input = keys.recv() => match input {
                Some(Input::Key(key)) => {
                    let was_paused = view.paused;
                    match on_key(key, &mut view, shown.headers.len()) {
                        Action::Quit => return Ok(()),
                        Action::None => continue,
                        Action::Changed => {}
                    }
                    if was_paused && !view.paused {
                        shown = updates.borrow_and_update().clone();
                    }
                }
                Some(Input::Resize) => {}
                Some(Input::Failed(e)) => return Err(e),
                None => return Ok(()),
            },
        }
        redraw(&shown, &view)?;
    }
}

/// The key reader thread: forwards keys and resizes until `tx` closes or
/// reading fails. Polls so as to notice a closed channel within 100 ms.
fn read_keys(tx: &mpsc::Sender<Input>) {
    while !tx.is_closed() {
        let input = match event::poll(Duration::from_millis(100)) {
            Ok(false) => continue,
            Ok(true) => match event::read() {
                Ok(Event::Key(key)) => Input::Key(key),
                Ok(Event::Resize(..)) => Input::Resize,
                Ok(_) => continue,
                Err(e) => Input::Failed(e),
            },
            Err(e) => Input::Failed(e),
        };
        let failed = matches!(input, Input::Failed(_));
        if tx.blocking_send(input).is_err() || failed {
            return;
        }
    }
}

/// The hook that was in place before [`Screen::enter`].
type Hook = Arc<dyn Fn(&PanicHookInfo<'_>) + Send + Sync + 'static>;

/// Whether the terminal is in raw mode on the alternate screen.
static ON_SCREEN: AtomicBool = AtomicBool::new(false);

/// The terminal in raw mode on the alternate screen, with a panic hook that
/// restores it before the panic is reported; [`Screen::leave`] (or dropping
/// it) restores the terminal and the previous hook.
struct Screen {
    previous: Option<Hook>,
}

impl Screen {
    fn enter() -> io::Result<Self> {
        let previous: Hook = Arc::from(panic::take_hook());
        let hook = Arc::clone(&previous);
        panic::set_hook(Box::new(move |info| {
            let _ = restore_terminal();
            hook(info);
        }));
        // From here on, dropping it undoes what was done.
        let mut screen = Screen {
            previous: Some(previous),
        };
        ON_SCREEN.store(true, AtomicOrdering::SeqCst);
        if let Err(e) = crossterm::terminal::enable_raw_mode()
            .and_then(|()| crossterm::execute!(io::stdout(), EnterAlternateScreen))
        {
            let _ = screen.leave();
            return Err(e);
        }
        Ok(screen)
    }

    /// Restores the terminal and the previous panic hook.
    fn leave(&mut self) -> io::Result<()> {
        let restored = restore_terminal();
        // A panicking thread may not change the hook: the one in place
        // calls the previous one anyway.
        if !thread::panicking()
            && let Some(previous) = self.previous.take()
        {
            let _ = panic::take_hook();
            panic::set_hook(Box::new(move |info| previous(info)));
        }
        restored
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let _ = self.leave();
    }
}

impl std::fmt::Debug for Screen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Screen").finish_non_exhaustive()
    }
}

/// Leaves raw mode and the alternate screen and shows the cursor, once.
fn restore_terminal() -> io::Result<()> {
    if !ON_SCREEN.swap(false, AtomicOrdering::SeqCst) {
        return Ok(());
    }
    let raw = crossterm::terminal::disable_raw_mode();
    let screen = crossterm::execute!(io::stdout(), LeaveAlternateScreen, crossterm::cursor::Show);
    raw.and(screen)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;

    fn cell(text: &str, sort: f64) -> Cell {
        Cell {
            text: text.to_owned(),
            sort,
        }
    }

    fn row(key: &str, bytes: f64, packets: f64, history: &[u64]) -> Row {
        Row {
            key: key.to_owned(),
            cells: vec![
                cell(&human_rate(bytes, "B/s"), bytes),
                cell(&human_rate(packets, "/s"), packets),
            ],
            history: history.to_vec(),
        }
    }

    /// Four groups: by bytes .2 > .1 > .4 > .3, by packets .3 > .4 > .1 > .2.
    fn snapshot() -> Snapshot {
        Snapshot {
            title: "demo/flows by rate(sum(value.bytes)) per key.daddr".to_owned(),
            key_header: "key.daddr".to_owned(),
            headers: vec!["bytes/s".to_owned(), "packets/s".to_owned()],
            rows: vec![
                row("10.1.0.1", 18_000_000.0, 1_200.0, &[0, 1, 2, 3, 4, 5, 6, 7]),
                row("10.1.0.2", 25_000_000.0, 900.0, &[7, 6, 5, 4, 3, 2, 1, 0]),
                row("10.1.0.3", 1_500.0, 40_000.0, &[5, 10]),
                row("10.1.0.4", 700_000.0, 3_000.0, &[]),
            ],
            hosts_ok: 3,
            hosts_total: 4,
            failing: vec![("10.0.0.7".to_owned(), "connection refused".to_owned())],
            // 14:02:03 UTC on some day.
            scan_time: Some(UNIX_EPOCH + Duration::from_secs(20_000 * 86_400 + 50_523)),
            interval: Duration::from_secs(1),
        }
    }

    fn view() -> ViewState {
        ViewState {
            sort: 0,
            ascending: false,
            limit: 10,
            paused: false,
        }
    }

    /// The screen's lines, trailing blanks cut.
    fn render(snap: &Snapshot, view: &ViewState, width: u16, height: u16) -> Vec<String> {
        let mut terminal = Terminal::new(TestBackend::new(width, height)).unwrap();
        terminal.draw(|frame| draw(frame, snap, view)).unwrap();
        lines(terminal.backend().buffer())
    }

    fn lines(buffer: &ratatui::buffer::Buffer) -> Vec<String> {
        let area = buffer.area;
        (0..area.height)
            .map(|y| {
                let line: String = (0..area.width).map(|x| buffer[(x, y)].symbol()).collect();
                line.trim_end().to_owned()
            })
            .collect()
    }

    /// The first word of each table row (below the title and header lines,
    /// above the status line).
    fn row_keys(screen: &[String]) -> Vec<&str> {
        screen[2..screen.len() - 1]
            .iter()
            .filter_map(|l| l.split_whitespace().next())
            .collect()
    }

    fn key(code: KeyCode) -> KeyEvent {
        KeyEvent::new(code, KeyModifiers::NONE)
    }

    #[test]
    fn draws_the_table_sorted_by_the_sort_column() {
        let screen = render(&snapshot(), &view(), 100, 8);
        assert_eq!(
            screen,
            [
                "demo/flows by rate(sum(value.bytes)) per key.daddr · 4 of 4 rows",
                "key.daddr   bytes/s ▼  packets/s  trend",
                "10.1.0.2    25.0 MB/s    900.0/s  █▇▆▅▄▃▂▁",
                "10.1.0.1    18.0 MB/s     1.2k/s  ▁▂▃▄▅▆▇█",
                "10.1.0.4   700.0 kB/s     3.0k/s",
                "10.1.0.3     1.5 kB/s    40.0k/s        ▅█",
                "",
                "3/4 hosts answering · 10.0.0.7: connection refused · last scan 14:02:03 UTC · every 1s · s/←/→ sort",
            ]
        );
    }

    #[test]
    fn ascending_flips_the_order_and_the_marker() {
        let view = ViewState {
            ascending: true,
            ..view()
        };
        let screen = render(&snapshot(), &view, 100, 8);
        assert_eq!(
            row_keys(&screen),
            ["10.1.0.3", "10.1.0.4", "10.1.0.1", "10.1.0.2"]
        );
        assert_eq!(screen[1], "key.daddr   bytes/s ▲  packets/s  trend");
    }

    #[test]
    fn the_second_column_sorts_and_carries_the_marker() {
        let view = ViewState { sort: 1, ..view() };
        let screen = render(&snapshot(), &view, 100, 8);
        assert_eq!(
            row_keys(&screen),
            ["10.1.0.3", "10.1.0.4", "10.1.0.1", "10.1.0.2"]
        );
        assert_eq!(screen[1], "key.daddr     bytes/s  packets/s ▼  trend");
        let view = ViewState {
            ascending: true,
            ..view
        };
        let screen = render(&snapshot(), &view, 100, 8);
        assert_eq!(
            row_keys(&screen),
            ["10.1.0.2", "10.1.0.1", "10.1.0.4", "10.1.0.3"]
        );
    }

    #[test]
    fn ties_go_by_key_and_nan_last() {
        let mut snap = snapshot();
        snap.rows[0].cells[0].sort = 700_000.0; // ties with 10.1.0.4
        snap.rows[1].cells[0].sort = f64::NAN;
        for ascending in [false, true] {
            let view = ViewState {
                ascending,
                ..view()
            };
            let order = if ascending {
                ["10.1.0.3", "10.1.0.1", "10.1.0.4", "10.1.0.2"]
            } else {
                ["10.1.0.1", "10.1.0.4", "10.1.0.3", "10.1.0.2"]
            };
            assert_eq!(row_keys(&render(&snap, &view, 100, 8)), order);
        }
    }

    #[test]
    fn the_limit_cuts_rows() {
        let view = ViewState { limit: 2, ..view() };
        let screen = render(&snapshot(), &view, 100, 8);
        assert_eq!(row_keys(&screen), ["10.1.0.2", "10.1.0.1"]);
        assert_eq!(
            screen[0],
            "demo/flows by rate(sum(value.bytes)) per key.daddr · 2 of 4 rows"
        );
        // 0: every row.
        let view = ViewState { limit: 0, ..view };
        assert_eq!(row_keys(&render(&snapshot(), &view, 100, 8)).len(), 4);
    }

    #[test]
    fn the_height_cuts_rows() {
        // Title, header, two rows, status.
        let screen = render(&snapshot(), &view(), 100, 5);
        assert_eq!(row_keys(&screen), ["10.1.0.2", "10.1.0.1"]);
        assert_eq!(
            screen[0],
            "demo/flows by rate(sum(value.bytes)) per key.daddr · 2 of 4 rows"
        );
    }

    #[test]
    fn the_status_line_names_hosts_failing_and_the_scan() {
        let screen = render(&snapshot(), &view(), 160, 8);
        assert_eq!(
            screen[7],
            "3/4 hosts answering · 10.0.0.7: connection refused · last scan 14:02:03 UTC · every 1s · \
             s/←/→ sort · r reverse · +/- rows · p pause · q quit"
        );

        let mut snap = snapshot();
        snap.hosts_ok = 1;
        snap.failing
            .push(("10.0.0.8".to_owned(), "deadline exceeded".to_owned()));
        snap.failing
            .push(("10.0.0.9".to_owned(), "unavailable".to_owned()));
        snap.scan_time = None;
        snap.interval = Duration::from_millis(500);
        let view = ViewState {
            paused: true,
            ..view()
        };
        let screen = render(&snap, &view, 200, 8);
        assert_eq!(
            screen[7],
            "1/4 hosts answering · 10.0.0.7: connection refused · 10.0.0.8: deadline exceeded · \
             1 more failing · no scan yet · paused · s/←/→ sort · r reverse · +/- rows · p resume · q quit"
        );
        assert!(
            screen[0].ends_with(" · 4 of 4 rows · paused"),
            "{}",
            screen[0]
        );
    }

    #[test]
    fn sparklines_scale_to_their_largest_value() {
        assert_eq!(sparkline(&[0, 1, 2, 3, 4, 5, 6, 7], 8), "▁▂▃▄▅▆▇█");
        assert_eq!(sparkline(&[5, 10], 4), "  ▅█");
        assert_eq!(sparkline(&[0, 0, 0], 3), "▁▁▁");
        assert_eq!(sparkline(&[], 2), "  ");
        // The last `width` values only: 100 is out of sight.
        assert_eq!(sparkline(&[100, 1, 2], 2), "▅█");
        assert_eq!(sparkline(&[u64::MAX, u64::MAX / 2], 2), "█▄");
    }

    #[test]
    fn human_rates() {
        assert_eq!(human_rate(18_000_000.0, "B/s"), "18.0 MB/s");
        assert_eq!(human_rate(1_234.0, "/s"), "1.2k/s");
        assert_eq!(human_rate(512.0, "B/s"), "512.0 B/s");
        assert_eq!(human_rate(0.5, "/s"), "0.5/s");
        assert_eq!(human_rate(999.96, "B/s"), "1.0 kB/s");
        assert_eq!(human_rate(2.5e9, "B/s"), "2.5 GB/s");
        assert_eq!(human_rate(-3_000.0, "/s"), "-3.0k/s");
        assert_eq!(human_rate(f64::NAN, "/s"), "-");
    }

    #[test]
    fn intervals_and_clock() {
        assert_eq!(interval(Duration::from_secs(1)), "1s");
        assert_eq!(interval(Duration::from_secs(120)), "2m");
        assert_eq!(interval(Duration::from_secs(90)), "90s");
        assert_eq!(interval(Duration::from_millis(250)), "250ms");
        assert_eq!(interval(Duration::from_millis(1500)), "1.5s");
        assert_eq!(
            clock(UNIX_EPOCH + Duration::from_secs(86_399)),
            "23:59:59 UTC"
        );
    }

    #[test]
    fn sort_keys_wrap_around() {
        let mut v = view();
        assert_eq!(on_key(key(KeyCode::Char('s')), &mut v, 3), Action::Changed);
        assert_eq!(v.sort, 1);
        assert_eq!(on_key(key(KeyCode::Right), &mut v, 3), Action::Changed);
        assert_eq!(v.sort, 2);
        assert_eq!(on_key(key(KeyCode::Char('s')), &mut v, 3), Action::Changed);
        assert_eq!(v.sort, 0);
        assert_eq!(on_key(key(KeyCode::Left), &mut v, 3), Action::Changed);
        assert_eq!(v.sort, 2);
        assert_eq!(on_key(key(KeyCode::Left), &mut v, 3), Action::Changed);
        assert_eq!(v.sort, 1);
        // One column: nothing to change; none: nothing to sort by.
        let mut v = view();
        assert_eq!(on_key(key(KeyCode::Right), &mut v, 1), Action::None);
        assert_eq!(on_key(key(KeyCode::Left), &mut v, 0), Action::None);
        assert_eq!(v, view());
    }

    #[test]
    fn reverse_pause_and_limit_keys() {
        let mut v = view();
        assert_eq!(on_key(key(KeyCode::Char('r')), &mut v, 2), Action::Changed);
        assert!(v.ascending);
        assert_eq!(on_key(key(KeyCode::Char('r')), &mut v, 2), Action::Changed);
        assert!(!v.ascending);
        assert_eq!(on_key(key(KeyCode::Char('p')), &mut v, 2), Action::Changed);
        assert!(v.paused);
        assert_eq!(on_key(key(KeyCode::Char('p')), &mut v, 2), Action::Changed);
        assert!(!v.paused);
        assert_eq!(on_key(key(KeyCode::Char('+')), &mut v, 2), Action::Changed);
        assert_eq!(v.limit, 11);
        let mut v = ViewState { limit: 2, ..view() };
        assert_eq!(on_key(key(KeyCode::Char('-')), &mut v, 2), Action::Changed);
        assert_eq!(on_key(key(KeyCode::Char('-')), &mut v, 2), Action::None);
        assert_eq!(v.limit, 1);
        let mut v = ViewState { limit: 0, ..view() };
        assert_eq!(on_key(key(KeyCode::Char('+')), &mut v, 2), Action::None);
        assert_eq!(on_key(key(KeyCode::Char('-')), &mut v, 2), Action::None);
        assert_eq!(v.limit, 0);
    }

    #[test]
    fn quit_keys() {
        let mut v = view();
        assert_eq!(on_key(key(KeyCode::Char('q')), &mut v, 2), Action::Quit);
        assert_eq!(on_key(key(KeyCode::Esc), &mut v, 2), Action::Quit);
        let ctrl_c = KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL);
        assert_eq!(on_key(ctrl_c, &mut v, 2), Action::Quit);
        assert_eq!(on_key(key(KeyCode::Char('c')), &mut v, 2), Action::None);
        assert_eq!(on_key(key(KeyCode::Char('x')), &mut v, 2), Action::None);
        // A release is no press.
        let release = KeyEvent::new_with_kind(
            KeyCode::Char('q'),
            KeyModifiers::NONE,
            KeyEventKind::Release,
        );
        assert_eq!(on_key(release, &mut v, 2), Action::None);
        assert_eq!(v, view());
    }

    /// The loop of `run` on a test backend: new snapshots redraw, a pause
    /// keeps the one shown, resuming shows the newest, `q` ends it.
    #[tokio::test]
    async fn the_loop_redraws_pauses_and_quits() {
        let (tx, rx) = watch::channel(snapshot());
        let (keys_tx, keys) = mpsc::channel(16);
        let (frames_tx, mut frames) = mpsc::unbounded_channel();
        let mut terminal = Terminal::new(TestBackend::new(100, 8)).unwrap();
        let task = tokio::spawn(live(rx, view(), keys, move |snap, view| {
            terminal.draw(|frame| draw(frame, snap, view)).unwrap();
            frames_tx.send(lines(terminal.backend().buffer())).unwrap();
            Ok(())
        }));
        let first = |screen: &[String]| row_keys(screen)[0].to_owned();

        assert_eq!(first(&frames.recv().await.unwrap()), "10.1.0.2");
        let mut next = snapshot();
        next.rows[2].cells[0].sort = 1e9;
        tx.send(next.clone()).unwrap();
        assert_eq!(first(&frames.recv().await.unwrap()), "10.1.0.3");

        keys_tx
            .send(Input::Key(key(KeyCode::Char('p'))))
            .await
            .unwrap();
        let paused = frames.recv().await.unwrap();
        assert!(paused[0].ends_with("· paused"), "{}", paused[0]);
        next.rows[3].cells[0].sort = 2e9;
        tx.send(next.clone()).unwrap();
        // Still paused: the next frame is the key's, over the old snapshot.
        keys_tx
            .send(Input::Key(key(KeyCode::Char('r'))))
            .await
            .unwrap();
        let reversed = frames.recv().await.unwrap();
        assert_eq!(
            row_keys(&reversed),
            ["10.1.0.4", "10.1.0.1", "10.1.0.2", "10.1.0.3"]
        );
        keys_tx
            .send(Input::Key(key(KeyCode::Char('r'))))
            .await
            .unwrap();
        frames.recv().await.unwrap();
        // Resuming shows the newest.
        keys_tx
            .send(Input::Key(key(KeyCode::Char('p'))))
            .await
            .unwrap();
        assert_eq!(first(&frames.recv().await.unwrap()), "10.1.0.4");

        // A dropped sender leaves the view up; an unknown key draws nothing.
        drop(tx);
        keys_tx
            .send(Input::Key(key(KeyCode::Char('x'))))
            .await
            .unwrap();
        keys_tx.send(Input::Resize).await.unwrap();
        assert_eq!(first(&frames.recv().await.unwrap()), "10.1.0.4");
        keys_tx
            .send(Input::Key(key(KeyCode::Char('q'))))
            .await
            .unwrap();
        task.await.unwrap().unwrap();
        assert!(frames.recv().await.is_none());
    }

    /// `run` can be spawned on the runtime; its future, never polled,
    /// touches no terminal.
    #[test]
    fn run_is_a_send_future() {
        fn send<T: Send>(_: &T) {}
        let (_tx, rx) = watch::channel(snapshot());
        let future = run(rx, view());
        send(&future);
    }

    #[tokio::test]
    async fn a_read_error_ends_the_loop() {
        let (_tx, rx) = watch::channel(snapshot());
        let (keys_tx, keys) = mpsc::channel(1);
        keys_tx
            .send(Input::Failed(io::Error::other("gone")))
            .await
            .unwrap();
        let err = live(rx, view(), keys, |_, _| Ok(())).await.unwrap_err();
        assert_eq!(err.to_string(), "gone");
    }
}
