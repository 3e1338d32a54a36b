//! Maps as Arrow tables: a [`MapLayout`] as a schema, and entries appended
//! to record batches column by column, read through the same plan of each
//! member as every other reader (offset, width, sign, byte order, bits,
//! rendering).
//!
//! The columns are the map's members by their paths, flattened: a struct
//! key gives `key.saddr`, `key.dport`, ...; a nested struct `value.stats.bytes`;
//! a key or value that is not a struct one column, `key` or `value`. These
//! are the names filters, `fields` and `group_by` take, and flat columns are
//! what pandas and SQL read without unnesting. Below a member, arrays are
//! `FixedSizeList`s and structs inside arrays `Struct`s. Per-CPU values are
//! either one list per entry (`values.packets`: each CPU's value, in CPU
//! order) or summed over the CPUs (`value.packets`), as the call asks.
//!
//! Types: integers of their width and sign (byte order applied; bitfields
//! in the width of their declared type); 128-bit integers as Decimal128(38,
//! 0), null above its 38 digits; enums as dictionaries of their
//! enumerators' names (a value no enumerator names as its number, in text);
//! bools; pointers as UInt64; floats; char arrays as Utf8 text (the
//! `string` rendering: up to the last NUL, other bytes escaped);
//! renderings as Utf8 (`ipv4`, `ipv6`, `mac`, `hex`, `string`) or numbers
//! (`be16` UInt16, `be32` UInt32); bytes without a type as
//! FixedSizeBinary. Sums over the CPUs of integers up to 32 bits are Int64,
//! wider ones Decimal128(38, 0): exact either way.

use std::{collections::HashMap, sync::Arc};

use arrow_array::{
    ArrayRef, Decimal128Array, DictionaryArray, FixedSizeBinaryArray, FixedSizeListArray,
    Int32Array, RecordBatch, StringArray, StructArray,
    builder::{BooleanBuilder, StringBuilder},
    types::Int32Type,
};
use arrow_buffer::ScalarBuffer;
use arrow_schema::{ArrowError, DataType, Field, Fields, Schema, SchemaRef};

use super::{
    EntryRef, EnumNode, IntField, MapLayout, Node, Rendering, Sink, rendering::escaped_text,
};

/// How a per-CPU map's values become columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PerCpuColumns {
    /// One list per entry and member, each CPU's value in CPU order
    /// (`values.x`).
    List,
    /// Each member summed over the CPUs (`value.x`): integers only.
    Sum,
}

/// What a table says of its map, in its schema's metadata.
#[derive(Debug, Clone, Default)]
pub struct TableInfo {
    /// The map as the call named it (a path, `id:N`, `name:NAME`).
    pub map: String,
    /// The map's kernel id.
    pub id: u32,
    /// The map's type ("hash", "percpu_array", ...).
    pub map_type: String,
}

/// Why a map cannot be a table as asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    /// Per-CPU sums of a member that is not an integer.
    #[error("{0}: per-CPU values are summed only when every member is an integer")]
    NotSummable(String),
}

/// A map's columns: its schema, and how each column reads an entry.
#[derive(Debug, Clone)]
pub struct TableLayout {
    schema: SchemaRef,
    key: Vec<Column>,
    value: Vec<Column>,
}

/// One column (or a member below one): its name and how it is read.
#[derive(Debug, Clone)]
struct Column {
    name: String,
    read: Read,
}

/// How a column reads its value from bytes that start where its record
/// (or array element) starts.
#[derive(Debug, Clone)]
enum Read {
    Int(IntField, Width),
    Enum(IntField, Arc<EnumNode>),
    Bool(IntField),
    Pointer(IntField),
    Float {
        at: usize,
        size: usize,
    },
    Text {
        at: usize,
        len: usize,
    },
    Bytes {
        at: usize,
        len: usize,
    },
    Rendered(Rendering, Arc<Node>, usize, usize),
    /// `length` elements `stride` bytes apart from `at`.
    List {
        element: Box<Column>,
        at: usize,
        length: usize,
        stride: usize,
    },
    Struct(Vec<Column>),
    /// The sum over the CPUs (each value `stride` bytes apart).
    Sum(IntField, Width),
    /// Each CPU's value of a column.
    PerCpu(Box<Column>, usize),
}

/// The Arrow integer type of an integer column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Width {
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    I128,
}

impl Width {
    fn of(bits: usize, signed: bool) -> Self {
        match (bits, signed) {
            (..=8, true) => Self::I8,
            (..=16, true) => Self::I16,
            (..=32, true) => Self::I32,
            (..=64, true) => Self::I64,
            (..=8, false) => Self::U8,
            (..=16, false) => Self::U16,
            (..=32, false) => Self::U32,
            (..=64, false) => Self::U64,
            _ => Self::I128,
        }
    }

    fn data_type(self) -> DataType {
        match self {
            Self::I8 => DataType::Int8,
            Self::I16 => DataType::Int16,
            Self::I32 => DataType::Int32,
            Self::I64 => DataType::Int64,
            Self::U8 => DataType::UInt8,
            Self::U16 => DataType::UInt16,
            Self::U32 => DataType::UInt32,
            Self::U64 => DataType::UInt64,
            Self::I128 => DataType::Decimal128(38, 0),
        }
    }
}

impl Read {
    fn data_type(&self) -> DataType {
        match self {
            Self::Int(_, w) | Self::Sum(_, w) => w.data_type(),
            Self::Enum(..) => {
                DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8))
            }
            Self::Bool(_) => DataType::Boolean,
            Self::Pointer(_) => DataType::UInt64,
            Self::Float { size: 4, .. } => DataType::Float32,
            Self::Float { .. } => DataType::Float64,
            Self::Text { .. } => DataType::Utf8,
            Self::Bytes { len, .. } => DataType::FixedSizeBinary(*len as i32),
            Self::Rendered(Rendering::Be16, ..) => DataType::UInt16,
            Self::Rendered(Rendering::Be32, ..) => DataType::UInt32,
            Self::Rendered(..) => DataType::Utf8,
            Self::List {
                element, length, ..
            } => DataType::FixedSizeList(Arc::new(element.field()), *length as i32),
            Self::PerCpu(element, cpus) => {
                DataType::FixedSizeList(Arc::new(element.field()), *cpus as i32)
            }
            Self::Struct(fields) => DataType::Struct(fields.iter().map(Column::field).collect()),
        }
    }

    /// Whether a value can be missing: a rendering of bytes it cannot
    /// show, a 128-bit value past Decimal128's digits.
    fn nullable(&self) -> bool {
        matches!(
            self,
            Self::Rendered(..) | Self::Int(_, Width::I128) | Self::Sum(_, Width::I128)
        )
    }
}

impl Column {
    fn field(&self) -> Field {
        let name = match self.name.as_str() {
            "" => "item",
            name => name,
        };
        Field::new(name, self.read.data_type(), self.read.nullable())
    }
}

/// The columns of `node`, named below `path` (its record's members
/// flattened into columns of their own).
fn columns(node: &Node, path: &str, at: usize, out: &mut Vec<Column>) {
    match node {
        Node::Record(r) => {
            for f in &r.fields {
                let name = format!("{path}.{}", f.name);
                match f.bitfield_size {
                    0 => columns(&f.node, &name, at + f.bit_offset / 8, out),
                    bits => out.push(Column {
                        name,
                        read: bitfield(&f.node, at * 8 + f.bit_offset, bits),
                    }),
                }
            }
        }
        other => out.push(Column {
            name: path.to_owned(),
            read: read(other, at),
        }),
    }
}

/// How a bitfield of `node`'s type is read.
fn bitfield(node: &Node, bit_offset: usize, bits: usize) -> Read {
    let (size, signed) = match node {
        Node::Int { size, signed, .. } => (*size, *signed),
        Node::Char { signed } => (1, *signed),
        Node::Enum(e) => {
            let field = IntField::bitfield(bit_offset, bits, e.signed);
            return Read::Enum(field, Arc::new(e.clone()));
        }
        Node::Bool { .. } => return Read::Bool(IntField::bitfield(bit_offset, bits, false)),
        Node::Pointer { size } => (*size, false),
        // A checked layout has no other bitfields.
        _ => (8, false),
    };
    Read::Int(
        IntField::bitfield(bit_offset, bits, signed),
        Width::of(size * 8, signed),
    )
}

/// How a member that is not a record's members is read, at `at`.
fn read(node: &Node, at: usize) -> Read {
    let whole = |size, signed, big_endian| IntField::whole(at, size, signed, big_endian);
    match node {
        Node::Int {
            size,
            signed,
            big_endian,
            ..
        } => Read::Int(
            whole(*size, *signed, *big_endian),
            Width::of(size * 8, *signed),
        ),
        Node::Char { signed } => Read::Int(whole(1, *signed, false), Width::of(8, *signed)),
        Node::Enum(e) => Read::Enum(whole(e.size, e.signed, false), Arc::new(e.clone())),
        Node::Bool { size } => Read::Bool(whole(*size, false, false)),
        Node::Pointer { size } => Read::Pointer(whole(*size, false, false)),
        Node::Float { size } => Read::Float { at, size: *size },
        Node::Opaque { size } => Read::Bytes { at, len: *size },
        Node::Rendered { how, node, size } => {
            Read::Rendered(*how, Arc::new((**node).clone()), at, *size)
        }
        Node::Array {
            element,
            element_size,
            length,
        } if element.is_char() => Read::Text {
            at,
            len: element_size * length,
        },
        Node::Array {
            element,
            element_size,
            length,
        } => Read::List {
            element: Box::new(Column {
                name: String::new(),
                read: element_read(element),
            }),
            at,
            length: *length,
            stride: *element_size,
        },
        Node::Record(r) => {
            let mut fields = Vec::new();
            for f in &r.fields {
                let read = match f.bitfield_size {
                    0 => read(&f.node, at + f.bit_offset / 8),
                    bits => bitfield(&f.node, at * 8 + f.bit_offset, bits),
                };
                fields.push(Column {
                    name: f.name.clone(),
                    read,
                });
            }
            Read::Struct(fields)
        }
    }
}

/// How an array's element is read, from its own start.
fn element_read(element: &Node) -> Read {
    read(element, 0)
}

/// The same columns, each summed over the CPUs.
fn summed(columns: Vec<Column>) -> Result<Vec<Column>, TableError> {
    columns
        .into_iter()
        .map(|c| {
            let field = match &c.read {
                Read::Int(field, _) => *field,
                Read::Rendered(_, node, at, _) => match **node {
                    Node::Int {
                        size,
                        signed,
                        big_endian,
                        ..
                    } => IntField::whole(*at, size, signed, big_endian),
                    _ => return Err(TableError::NotSummable(c.name)),
                },
                _ => return Err(TableError::NotSummable(c.name)),
            };
            let width = match field.bits() {
                ..=32 => Width::I64,
                _ => Width::I128,
            };
            Ok(Column {
                name: c.name,
                read: Read::Sum(field, width),
            })
        })
        .collect()
}

impl TableLayout {
    /// The columns of `layout`'s entries (a projection's records too),
    /// per-CPU values as `per_cpu` says.
    pub fn new(
        layout: &MapLayout,
        per_cpu: PerCpuColumns,
        info: &TableInfo,
    ) -> Result<Self, TableError> {
        let mut key = Vec::new();
        if layout.key().size() > 0 {
            columns(&layout.key().root, "key", 0, &mut key);
        }
        let mut value = Vec::new();
        let cpus = layout.cpus();
        match (cpus, per_cpu) {
            (Some(_), PerCpuColumns::Sum) => {
                let sums = layout.value_for_sums();
                columns(&sums.root, "value", 0, &mut value);
                value = summed(value)?;
            }
            (Some(n), PerCpuColumns::List) => {
                columns(&layout.value().root, "values", 0, &mut value);
                value = value
                    .into_iter()
                    .map(|c| Column {
                        name: c.name.clone(),
                        read: Read::PerCpu(
                            Box::new(Column {
                                name: String::new(),
                                read: c.read,
                            }),
                            n,
                        ),
                    })
                    .collect();
            }
            (None, _) if layout.value().size() > 0 => {
                columns(&layout.value().root, "value", 0, &mut value)
            }
            (None, _) => {}
        }
        let fields: Vec<Field> = key.iter().chain(&value).map(Column::field).collect();
        let metadata = HashMap::from([
            ("bpfmap.map".to_owned(), info.map.clone()),
            ("bpfmap.map_id".to_owned(), info.id.to_string()),
            ("bpfmap.map_type".to_owned(), info.map_type.clone()),
            ("bpfmap.key_type".to_owned(), layout.key().name().to_owned()),
            (
                "bpfmap.value_type".to_owned(),
                layout.value().name().to_owned(),
            ),
        ]);
        Ok(Self {
            schema: Arc::new(Schema::new_with_metadata(fields, metadata)),
            key,
            value,
        })
    }

    /// The table's schema.
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// An empty batch to append entries to.
    pub fn builder(&self) -> TableBuilder<'_> {
        let columns = self.key.iter().chain(&self.value).map(Buf::of).collect();
        TableBuilder {
            layout: self,
            columns,
            rows: 0,
        }
    }
}

/// Record batches of a [`TableLayout`], entry by entry.
pub struct TableBuilder<'a> {
    layout: &'a TableLayout,
    columns: Vec<Buf>,
    rows: usize,
}

impl std::fmt::Debug for TableBuilder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableBuilder")
            .field("schema", self.layout.schema())
            .field("rows", &self.rows)
            .finish()
    }
}

impl TableBuilder<'_> {
    /// Appends an entry (per-CPU values back to back, `stride` bytes each).
    pub fn push(&mut self, e: EntryRef<'_>) {
        let keys = self.layout.key.len();
        for (c, buf) in self.layout.key.iter().zip(&mut self.columns) {
            buf.push(&c.read, e.key, 0);
        }
        for (c, buf) in self.layout.value.iter().zip(&mut self.columns[keys..]) {
            buf.push(&c.read, e.value, e.stride);
        }
        self.rows += 1;
    }

    /// Appends records laid out back to back (a packed chunk), column by
    /// column: integers of whole bytes are read in one pass over the
    /// records each, other members record by record.
    pub fn push_packed(&mut self, records: Packed<'_>) {
        let Packed {
            keys,
            key_size,
            values,
            value_stride,
            cpu_stride,
            count,
        } = records;
        let keys_n = self.layout.key.len();
        let (key_cols, value_cols) = self.columns.split_at_mut(keys_n);
        for (c, buf) in self.layout.key.iter().zip(key_cols) {
            buf.extend(&c.read, Rows::new(keys, key_size, count), 0);
        }
        for (c, buf) in self.layout.value.iter().zip(value_cols) {
            buf.extend(&c.read, Rows::new(values, value_stride, count), cpu_stride);
        }
        self.rows += count;
    }

    /// Entries appended since the last batch.
    pub fn len(&self) -> usize {
        self.rows
    }

    /// Whether no entry was appended since the last batch.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// The batch of the entries appended since the last one.
    pub fn finish(&mut self) -> Result<RecordBatch, ArrowError> {
        let layout = self.layout;
        let arrays: Vec<ArrayRef> = layout
            .key
            .iter()
            .chain(&layout.value)
            .zip(&mut self.columns)
            .map(|(c, buf)| buf.finish(&c.read))
            .collect::<Result<_, _>>()?;
        let rows = std::mem::take(&mut self.rows);
        let options = arrow_array::RecordBatchOptions::new().with_row_count(Some(rows));
        RecordBatch::try_new_with_options(layout.schema.clone(), arrays, &options)
    }
}

/// Records laid out back to back, as a packed chunk carries them.
#[derive(Debug, Clone, Copy)]
pub struct Packed<'a> {
    /// `count` keys of `key_size` bytes.
    pub keys: &'a [u8],
    pub key_size: usize,
    /// `count` values, `value_stride` bytes apart.
    pub values: &'a [u8],
    pub value_stride: usize,
    /// Per-CPU values: each CPU's value `cpu_stride` bytes apart inside a
    /// value (0 otherwise).
    pub cpu_stride: usize,
    pub count: usize,
}

/// `count` records of `size` bytes each (missing bytes read as absent).
struct Rows<'a> {
    bytes: &'a [u8],
    size: usize,
    count: usize,
}

impl<'a> Rows<'a> {
    fn new(bytes: &'a [u8], size: usize, count: usize) -> Self {
        Self { bytes, size, count }
    }

    /// Each record.
    fn each(&self) -> impl Iterator<Item = &'a [u8]> + '_ {
        (0..self.count).map(|i| {
            let start = (i * self.size).min(self.bytes.len());
            let end = (start + self.size).min(self.bytes.len());
            &self.bytes[start..end]
        })
    }

    /// Every record whole (the fast paths need them).
    fn whole(&self) -> Option<std::slice::ChunksExact<'a, u8>> {
        let len = self.size.checked_mul(self.count)?;
        (self.size > 0 && self.bytes.len() >= len)
            .then(|| self.bytes[..len].chunks_exact(self.size))
    }
}

/// `N` bytes at `at` of each record, read by `from`.
fn ints<const N: usize, T>(
    v: &mut Vec<T>,
    rows: std::slice::ChunksExact<'_, u8>,
    at: usize,
    from: fn([u8; N]) -> T,
) {
    v.extend(rows.map(|r| from(r[at..at + N].try_into().expect("N bytes"))));
}

/// A column's values so far.
enum Buf {
    I8(Vec<i8>),
    I16(Vec<i16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    U8(Vec<u8>),
    U16(Vec<u16>),
    U32(Vec<u32>),
    U64(Vec<u64>),
    I128(Vec<Option<i128>>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(BooleanBuilder),
    Str(StringBuilder),
    Dict(EnumColumn),
    Bytes(Vec<u8>),
    List(Box<Buf>),
    Struct(Vec<Buf>, usize),
}

impl Buf {
    fn of(c: &Column) -> Self {
        Self::for_read(&c.read)
    }

    fn for_read(read: &Read) -> Self {
        match read {
            Read::Int(_, w) | Read::Sum(_, w) => match w {
                Width::I8 => Self::I8(Vec::new()),
                Width::I16 => Self::I16(Vec::new()),
                Width::I32 => Self::I32(Vec::new()),
                Width::I64 => Self::I64(Vec::new()),
                Width::U8 => Self::U8(Vec::new()),
                Width::U16 => Self::U16(Vec::new()),
                Width::U32 => Self::U32(Vec::new()),
                Width::U64 => Self::U64(Vec::new()),
                Width::I128 => Self::I128(Vec::new()),
            },
            Read::Pointer(_) => Self::U64(Vec::new()),
            Read::Enum(field, e) => Self::Dict(EnumColumn::new(field, e.clone())),
            Read::Bool(_) => Self::Bool(BooleanBuilder::new()),
            Read::Float { size: 4, .. } => Self::F32(Vec::new()),
            Read::Float { .. } => Self::F64(Vec::new()),
            Read::Text { .. } => Self::Str(StringBuilder::new()),
            Read::Bytes { .. } => Self::Bytes(Vec::new()),
            Read::Rendered(Rendering::Be16, ..) => Self::U16(Vec::new()),
            Read::Rendered(Rendering::Be32, ..) => Self::U32(Vec::new()),
            Read::Rendered(..) => Self::Str(StringBuilder::new()),
            Read::List { element, .. } | Read::PerCpu(element, _) => {
                Self::List(Box::new(Self::for_read(&element.read)))
            }
            Read::Struct(fields) => Self::Struct(fields.iter().map(Self::of).collect(), 0),
        }
    }

    /// Appends the values `read` reads from each of `rows` (for per-CPU
    /// columns: CPU values `stride` bytes apart): integers of whole bytes
    /// in one pass, the others record by record.
    fn extend(&mut self, read: &Read, rows: Rows<'_>, stride: usize) {
        if let (Read::Int(f, _), Some(whole)) = (read, rows.whole())
            && !f.is_bitfield()
            && f.offset() + f.bits() / 8 <= rows.size
        {
            let at = f.offset();
            match (self, f.bits(), f.big_endian()) {
                (Self::U8(v), 8, _) => ints(v, whole, at, |[b]: [u8; 1]| b),
                (Self::I8(v), 8, _) => ints(v, whole, at, |[b]: [u8; 1]| b as i8),
                (Self::U16(v), 16, false) => ints(v, whole, at, u16::from_le_bytes),
                (Self::U16(v), 16, true) => ints(v, whole, at, u16::from_be_bytes),
                (Self::I16(v), 16, false) => ints(v, whole, at, i16::from_le_bytes),
                (Self::I16(v), 16, true) => ints(v, whole, at, i16::from_be_bytes),
                (Self::U32(v), 32, false) => ints(v, whole, at, u32::from_le_bytes),
                (Self::U32(v), 32, true) => ints(v, whole, at, u32::from_be_bytes),
                (Self::I32(v), 32, false) => ints(v, whole, at, i32::from_le_bytes),
                (Self::I32(v), 32, true) => ints(v, whole, at, i32::from_be_bytes),
                (Self::U64(v), 64, false) => ints(v, whole, at, u64::from_le_bytes),
                (Self::U64(v), 64, true) => ints(v, whole, at, u64::from_be_bytes),
                (Self::I64(v), 64, false) => ints(v, whole, at, i64::from_le_bytes),
                (Self::I64(v), 64, true) => ints(v, whole, at, i64::from_be_bytes),
                (buf, ..) => buf.extend_each(read, &rows, stride),
            }
            return;
        }
        if let (Self::Dict(column), Read::Enum(f, _), Some(whole)) =
            (&mut *self, read, rows.whole())
            && column.by_byte.is_some()
            && !f.is_bitfield()
            && f.bits() == 8
            && f.offset() < rows.size
        {
            let at = f.offset();
            column.keys.reserve(whole.len());
            for r in whole {
                column.push_byte(r[at]);
            }
            return;
        }
        if let (Read::Int(f, _), Some(whole)) = (read, rows.whole())
            && f.is_bitfield()
            && f.bits() <= 56
            && f.offset() + 8 <= rows.size
        {
            // A bitfield within the eight bytes from its first: one load,
            // a shift and a mask.
            let (at, shift, mask) = (f.offset(), f.bit_offset() % 8, (1u64 << f.bits()) - 1);
            let raw = whole.map(|r| {
                let word = u64::from_le_bytes(r[at..at + 8].try_into().expect("8 bytes"));
                (word >> shift) & mask
            });
            let value = |raw: u64| f.sign_extended(u128::from(raw));
            match self {
                Self::U8(v) => v.extend(raw.map(|r| r as u8)),
                Self::U16(v) => v.extend(raw.map(|r| r as u16)),
                Self::U32(v) => v.extend(raw.map(|r| r as u32)),
                Self::U64(v) => v.extend(raw),
                Self::I8(v) => v.extend(raw.map(|r| value(r) as i8)),
                Self::I16(v) => v.extend(raw.map(|r| value(r) as i16)),
                Self::I32(v) => v.extend(raw.map(|r| value(r) as i32)),
                Self::I64(v) => v.extend(raw.map(|r| value(r) as i64)),
                buf => buf.extend_each(read, &rows, stride),
            }
            return;
        }
        self.extend_each(read, &rows, stride);
    }

    fn extend_each(&mut self, read: &Read, rows: &Rows<'_>, stride: usize) {
        for r in rows.each() {
            self.push(read, r, stride);
        }
    }

    /// Appends the value `read` reads from `b` (for per-CPU columns: CPU
    /// values `stride` bytes apart).
    fn push(&mut self, read: &Read, b: &[u8], stride: usize) {
        match (self, read) {
            (
                Self::List(inner),
                Read::List {
                    element,
                    at,
                    length,
                    stride,
                },
            ) => {
                for i in 0..*length {
                    let start = (at + i * stride).min(b.len());
                    inner.push(&element.read, &b[start..], 0);
                }
            }
            (Self::List(inner), Read::PerCpu(element, cpus)) => {
                for cpu in 0..*cpus {
                    let start = (cpu * stride).min(b.len());
                    inner.push(&element.read, &b[start..], 0);
                }
            }
            (Self::Struct(fields, rows), Read::Struct(columns)) => {
                for (buf, c) in fields.iter_mut().zip(columns) {
                    buf.push(&c.read, b, 0);
                }
                *rows += 1;
            }
            (buf, Read::Sum(field, _)) => {
                let cpus = b.len().checked_div(stride).unwrap_or(0);
                let sum = field.sum((0..cpus).map(|i| &b[i * stride..(i + 1) * stride]));
                match buf {
                    Self::I64(v) => v.push(sum.unwrap_or(0) as i64),
                    Self::I128(v) => v.push(sum),
                    _ => {}
                }
            }
            (buf, read) => buf.push_scalar(read, b),
        }
    }

    fn push_scalar(&mut self, read: &Read, b: &[u8]) {
        match (self, read) {
            (buf, Read::Int(field, _)) => {
                let raw = field.raw(b).unwrap_or(0);
                buf.push_int(field, raw);
            }
            (Self::U64(v), Read::Pointer(field)) => v.push(field.raw(b).unwrap_or(0) as u64),
            (Self::Dict(d), Read::Enum(field, _)) => match &d.by_byte {
                Some(_) => d.push_byte(field.raw(b).unwrap_or(0) as u8),
                None => d.push(field.value(b).unwrap_or(0)),
            },
            (Self::Bool(v), Read::Bool(field)) => v.append_value(field.raw(b).unwrap_or(0) != 0),
            (Self::F32(v), Read::Float { at, .. }) => v.push(
                at.checked_add(4)
                    .and_then(|end| b.get(*at..end))
                    .and_then(|s| s.try_into().ok())
                    .map_or(0.0, f32::from_le_bytes),
            ),
            (Self::F64(v), Read::Float { at, .. }) => v.push(
                at.checked_add(8)
                    .and_then(|end| b.get(*at..end))
                    .and_then(|s| s.try_into().ok())
                    .map_or(0.0, f64::from_le_bytes),
            ),
            (Self::Str(s), Read::Text { at, len }) => {
                append_text(s, super::render::slice(b, *at, *len))
            }
            (Self::Bytes(v), Read::Bytes { at, len }) => {
                let bytes = super::render::slice(b, *at, *len);
                v.extend_from_slice(bytes);
                v.resize(v.len() + len - bytes.len(), 0);
            }
            (buf, Read::Rendered(how, node, at, size)) => {
                let mut shown = Shown::None;
                how.render(node, super::render::slice(b, *at, *size), &mut shown);
                buf.push_shown(shown);
            }
            _ => {}
        }
    }

    fn push_int(&mut self, field: &IntField, raw: u128) {
        let value = || field.sign_extended(raw);
        match self {
            Self::I8(v) => v.push(value() as i8),
            Self::I16(v) => v.push(value() as i16),
            Self::I32(v) => v.push(value() as i32),
            Self::I64(v) => v.push(value() as i64),
            Self::U8(v) => v.push(raw as u8),
            Self::U16(v) => v.push(raw as u16),
            Self::U32(v) => v.push(raw as u32),
            Self::U64(v) => v.push(raw as u64),
            Self::I128(v) => v.push(match field.signed() {
                true => Some(value()),
                false => i128::try_from(raw).ok().filter(|v| *v < DECIMAL_MAX),
            }),
            _ => {}
        }
    }

    fn push_shown(&mut self, shown: Shown) {
        match (self, shown) {
            (Self::Str(s), Shown::Text(t)) => s.append_value(t),
            (Self::Str(s), _) => s.append_null(),
            (Self::U16(v), Shown::Int(i)) => v.push(i as u16),
            (Self::U32(v), Shown::Int(i)) => v.push(i as u32),
            (Self::U16(v), _) => v.push(0),
            (Self::U32(v), _) => v.push(0),
            _ => {}
        }
    }

    fn finish(&mut self, read: &Read) -> Result<ArrayRef, ArrowError> {
        use arrow_array::{Array as _, PrimitiveArray};
        fn prim<T: arrow_array::ArrowPrimitiveType>(v: &mut Vec<T::Native>) -> ArrayRef {
            Arc::new(PrimitiveArray::<T>::new(
                ScalarBuffer::from(std::mem::take(v)),
                None,
            ))
        }
        use arrow_array::types as t;
        Ok(match self {
            Self::I8(v) => prim::<t::Int8Type>(v),
            Self::I16(v) => prim::<t::Int16Type>(v),
            Self::I32(v) => prim::<t::Int32Type>(v),
            Self::I64(v) => prim::<t::Int64Type>(v),
            Self::U8(v) => prim::<t::UInt8Type>(v),
            Self::U16(v) => prim::<t::UInt16Type>(v),
            Self::U32(v) => prim::<t::UInt32Type>(v),
            Self::U64(v) => prim::<t::UInt64Type>(v),
            Self::F32(v) => prim::<t::Float32Type>(v),
            Self::F64(v) => prim::<t::Float64Type>(v),
            Self::I128(v) => Arc::new(
                std::mem::take(v)
                    .into_iter()
                    .collect::<Decimal128Array>()
                    .with_precision_and_scale(38, 0)?,
            ),
            Self::Bool(b) => Arc::new(b.finish()),
            Self::Str(s) => Arc::new(s.finish()),
            Self::Dict(d) => Arc::new(d.finish()?),
            Self::Bytes(v) => {
                let Read::Bytes { len, .. } = read else {
                    return Err(ArrowError::SchemaError("a column of bytes".into()));
                };
                let data = std::mem::take(v);
                let rows = data.len().checked_div(*len).unwrap_or(0);
                Arc::new(FixedSizeBinaryArray::try_new_with_len(
                    *len as i32,
                    data.into(),
                    None,
                    rows,
                )?)
            }
            Self::List(inner) => {
                let (element, length) = match read {
                    Read::List {
                        element, length, ..
                    } => (element, *length),
                    Read::PerCpu(element, cpus) => (element, *cpus),
                    _ => return Err(ArrowError::SchemaError("a list column".into())),
                };
                let values = inner.finish(&element.read)?;
                let rows = values.len().checked_div(length).unwrap_or(0);
                Arc::new(FixedSizeListArray::try_new_with_length(
                    Arc::new(element.field()),
                    length as i32,
                    values,
                    None,
                    rows,
                )?)
            }
            Self::Struct(fields, rows) => {
                let Read::Struct(columns) = read else {
                    return Err(ArrowError::SchemaError("a struct column".into()));
                };
                let arrays = fields
                    .iter_mut()
                    .zip(columns)
                    .map(|(buf, c)| buf.finish(&c.read))
                    .collect::<Result<Vec<_>, _>>()?;
                let fields: Fields = columns.iter().map(Column::field).collect();
                Arc::new(StructArray::try_new_with_length(
                    fields,
                    arrays,
                    None,
                    std::mem::take(rows),
                )?)
            }
        })
    }
}

/// An enum column: each row's key into its dictionary, the dictionary
/// being the names of the values in the order they first appeared (as
/// arrow's dictionary builder makes it; a value no enumerator names is its
/// number, in text), found without hashing text.
struct EnumColumn {
    node: Arc<EnumNode>,
    keys: Vec<i32>,
    names: Vec<String>,
    /// For an unsigned enum of one byte: each byte's key, once it has one.
    by_byte: Option<Box<[Option<i32>; 256]>>,
    /// For other enums: each value's key.
    by_value: HashMap<i128, i32>,
}

impl EnumColumn {
    fn new(field: &IntField, node: Arc<EnumNode>) -> Self {
        let byte = !field.signed() && field.bits() <= 8;
        Self {
            node,
            keys: Vec::new(),
            names: Vec::new(),
            by_byte: byte.then(|| Box::new([None; 256])),
            by_value: HashMap::new(),
        }
    }

    /// The key of `value`, named and added to the dictionary the first
    /// time.
    fn key(names: &mut Vec<String>, node: &EnumNode, value: i128) -> i32 {
        names.push(
            node.name_of(value as i64)
                .map_or_else(|| value.to_string(), str::to_owned),
        );
        names.len() as i32 - 1
    }

    /// Appends a one-byte enum's value.
    #[inline]
    fn push_byte(&mut self, byte: u8) {
        let Some(by_byte) = self.by_byte.as_mut() else {
            return self.push(i128::from(byte));
        };
        let key = *by_byte[usize::from(byte)]
            .get_or_insert_with(|| Self::key(&mut self.names, &self.node, i128::from(byte)));
        self.keys.push(key);
    }

    fn push(&mut self, value: i128) {
        let key = *self
            .by_value
            .entry(value)
            .or_insert_with(|| Self::key(&mut self.names, &self.node, value));
        self.keys.push(key);
    }

    /// The column so far, its dictionary made again for the next batch.
    fn finish(&mut self) -> Result<DictionaryArray<Int32Type>, ArrowError> {
        let keys = Int32Array::from(std::mem::take(&mut self.keys));
        let values = StringArray::from(std::mem::take(&mut self.names));
        if let Some(by_byte) = self.by_byte.as_mut() {
            **by_byte = [None; 256];
        }
        self.by_value.clear();
        DictionaryArray::try_new(keys, Arc::new(values))
    }
}

/// The largest value Decimal128(38, 0) holds, plus one.
const DECIMAL_MAX: i128 = 10i128.pow(38);

/// What a rendering shows: text, a number, or nothing.
#[derive(Debug)]
enum Shown {
    None,
    Text(String),
    Int(i64),
}

impl Sink for Shown {
    fn null(&mut self) {
        *self = Self::None;
    }
    fn bool(&mut self, v: bool) {
        *self = Self::Int(i64::from(v));
    }
    fn int(&mut self, v: i64) {
        *self = Self::Int(v);
    }
    fn decimal(&mut self, v: i128) {
        *self = Self::Text(v.to_string());
    }
    fn decimal_unsigned(&mut self, v: u128) {
        *self = Self::Text(v.to_string());
    }
    fn float(&mut self, v: f64) {
        *self = Self::Text(v.to_string());
    }
    fn string(&mut self, s: &str) {
        *self = Self::Text(s.to_owned());
    }
    fn pointer(&mut self, v: u64) {
        *self = Self::Text(format!("{v:#x}"));
    }
    fn hex(&mut self, bytes: &[u8]) {
        *self = Self::Text(faster_hex::hex_string(bytes));
    }
    fn begin_object(&mut self) {}
    fn key(&mut self, _: &str) {}
    fn end_object(&mut self) {}
    fn begin_array(&mut self) {}
    fn end_array(&mut self) {}
}

/// A char array's text (`escaped_text`), without a copy of its own when it
/// is printable ASCII up to its last NUL.
fn append_text(s: &mut StringBuilder, b: &[u8]) {
    let end = b.iter().rposition(|&c| c != 0).map_or(0, |i| i + 1);
    let plain = b[..end]
        .iter()
        .all(|&c| (0x20..0x7f).contains(&c) && c != b'\\');
    match std::str::from_utf8(&b[..end]) {
        Ok(text) if plain => s.append_value(text),
        _ => s.append_value(escaped_text(b)),
    }
}

/// `schema` with a `target` column first (Utf8): the table of a fleet, one
/// row per entry of each target.
pub fn with_target(schema: &SchemaRef) -> SchemaRef {
    let mut fields = vec![Arc::new(Field::new("target", DataType::Utf8, false))];
    fields.extend(schema.fields().iter().cloned());
    Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
}

/// The column of an aggregate in a table of groups: named as bpfmapctl
/// spells it ("sum(value.bytes)"), an exact decimal (null for the MIN or
/// MAX of a group without entries).
pub fn aggregate_field(a: &crate::v1::Aggregate) -> Field {
    Field::new(
        crate::aggregate::spelling(a),
        DataType::Decimal128(38, 0),
        true,
    )
}

/// An aggregate's value as AggregateMap answers it (a decimal string or a
/// number); none for the MIN or MAX of a group without entries.
pub fn aggregate_decimal(v: &prost_types::Value) -> Option<i128> {
    use prost_types::value::Kind;
    match v.kind.as_ref()? {
        Kind::StringValue(s) => s.parse().ok(),
        Kind::NumberValue(n) => Some(*n as i128),
        _ => None,
    }
}

/// The values of an aggregate's column.
pub fn aggregate_array(
    values: impl IntoIterator<Item = Option<i128>>,
) -> Result<ArrayRef, ArrowError> {
    let array = values
        .into_iter()
        .collect::<Decimal128Array>()
        .with_precision_and_scale(38, 0)?;
    Ok(Arc::new(array))
}
