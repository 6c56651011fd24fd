//! Decoder for the pgoutput logical replication protocol (version 1), the bytes inside each
//! XLogData message. Every read is bounds-checked: malformed input is an error, never a panic.
//! Reference: PostgreSQL docs, "Logical Replication Message Formats".

use bytes::Bytes;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    pub flags: u8,
    pub name: String,
    pub(crate) type_oid: u32,
    pub(crate) type_modifier: i32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub id: u32,
    pub namespace: String,
    pub name: String,
    pub(crate) replica_identity: u8,
    pub columns: Vec<Column>,
}

/// One column value of a tuple.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Null,
    /// A TOASTed value that did not change (updates only).
    Unchanged,
    Text(Bytes),
    Binary(Bytes),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Begin {
        final_lsn: u64,
        commit_time: i64,
        xid: u32,
    },
    Commit {
        flags: u8,
        commit_lsn: u64,
        end_lsn: u64,
        commit_time: i64,
    },
    Origin {
        lsn: u64,
        name: String,
    },
    Relation(Relation),
    Type {
        oid: u32,
        namespace: String,
        name: String,
    },
    Insert {
        relation_id: u32,
        tuple: Vec<Value>,
    },
    Update {
        relation_id: u32,
        old: Option<Vec<Value>>,
        new: Vec<Value>,
    },
    Delete {
        relation_id: u32,
        old: Vec<Value>,
    },
    Truncate {
        options: u8,
        relation_ids: Vec<u32>,
    },
    Message {
        transactional: bool,
        lsn: u64,
        prefix: String,
        content: Bytes,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed pgoutput message at byte {offset}: {what}")]
pub struct DecodeError {
    pub offset: usize,
    pub what: String,
}

struct Reader {
    data: Bytes,
    pos: usize,
}

impl Reader {
    fn err(&self, what: impl Into<String>) -> DecodeError {
        DecodeError {
            offset: self.pos,
            what: what.into(),
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<Bytes, DecodeError> {
        if self.data.len() - self.pos < n {
            return Err(self.err(format!(
                "{what}: needs {n} bytes, {} left",
                self.data.len() - self.pos
            )));
        }
        let b = self.data.slice(self.pos..self.pos + n);
        self.pos += n;
        Ok(b)
    }

    fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16, DecodeError> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &str) -> Result<u32, DecodeError> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, DecodeError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(&b);
        Ok(u64::from_be_bytes(a))
    }

    fn cstring(&mut self, what: &str) -> Result<String, DecodeError> {
        let rest = &self.data[self.pos..];
        let end = rest
            .iter()
            .position(|&c| c == 0)
            .ok_or_else(|| self.err(format!("{what}: unterminated string")))?;
        let s = std::str::from_utf8(&rest[..end])
            .map_err(|_| self.err(format!("{what}: not UTF-8")))?
            .to_owned();
        self.pos += end + 1;
        Ok(s)
    }

    fn tuple(&mut self) -> Result<Vec<Value>, DecodeError> {
        let n = self.u16("tuple column count")? as usize;
        // Each column takes at least one byte: refuse counts the input cannot hold before
        // allocating for them.
        if n > self.data.len() - self.pos {
            return Err(self.err(format!("tuple claims {n} columns")));
        }
        let mut values = Vec::with_capacity(n);
        for _ in 0..n {
            let kind = self.u8("tuple value kind")?;
            values.push(match kind {
                b'n' => Value::Null,
                b'u' => Value::Unchanged,
                b't' | b'b' => {
                    let len = self.u32("value length")?;
                    let bytes = self.take(len as usize, "value")?;
                    if kind == b't' {
                        Value::Text(bytes)
                    } else {
                        Value::Binary(bytes)
                    }
                }
                other => return Err(self.err(format!("unknown tuple value kind 0x{other:02x}"))),
            });
        }
        Ok(values)
    }

    fn finish(self, msg: Message) -> Result<Message, DecodeError> {
        if self.pos != self.data.len() {
            return Err(self.err(format!("{} trailing bytes", self.data.len() - self.pos)));
        }
        Ok(msg)
    }
}

/// Decodes one pgoutput message.
pub fn decode(data: Bytes) -> Result<Message, DecodeError> {
    let mut r = Reader { data, pos: 0 };
    let tag = r.u8("message tag")?;
    let msg = match tag {
        b'B' => Message::Begin {
            final_lsn: r.u64("final LSN")?,
            commit_time: r.u64("commit time")? as i64,
            xid: r.u32("xid")?,
        },
        b'C' => Message::Commit {
            flags: r.u8("flags")?,
            commit_lsn: r.u64("commit LSN")?,
            end_lsn: r.u64("end LSN")?,
            commit_time: r.u64("commit time")? as i64,
        },
        b'O' => Message::Origin {
            lsn: r.u64("origin LSN")?,
            name: r.cstring("origin name")?,
        },
        b'R' => {
            let id = r.u32("relation id")?;
            let namespace = r.cstring("namespace")?;
            let name = r.cstring("relation name")?;
            let replica_identity = r.u8("replica identity")?;
            let n = r.u16("column count")? as usize;
            if n > r.data.len() - r.pos {
                return Err(r.err(format!("relation claims {n} columns")));
            }
            let mut columns = Vec::with_capacity(n);
            for _ in 0..n {
                columns.push(Column {
                    flags: r.u8("column flags")?,
                    name: r.cstring("column name")?,
                    type_oid: r.u32("column type")?,
                    type_modifier: r.u32("column type modifier")? as i32,
                });
            }
            Message::Relation(Relation {
                id,
                namespace,
                name,
                replica_identity,
                columns,
            })
        }
        b'Y' => Message::Type {
            oid: r.u32("type oid")?,
            namespace: r.cstring("type namespace")?,
            name: r.cstring("type name")?,
        },
        b'I' => {
            let relation_id = r.u32("relation id")?;
            match r.u8("insert tuple tag")? {
                b'N' => {}
                other => return Err(r.err(format!("insert: expected 'N', got 0x{other:02x}"))),
            }
            Message::Insert {
                relation_id,
                tuple: r.tuple()?,
            }
        }
        b'U' => {
            let relation_id = r.u32("relation id")?;
            let mut old = None;
            let mut tag = r.u8("update tuple tag")?;
            if tag == b'K' || tag == b'O' {
                old = Some(r.tuple()?);
                tag = r.u8("update new tuple tag")?;
            }
            if tag != b'N' {
                return Err(r.err(format!("update: expected 'N', got 0x{tag:02x}")));
            }
            Message::Update {
                relation_id,
                old,
                new: r.tuple()?,
            }
        }
        b'D' => {
            let relation_id = r.u32("relation id")?;
            match r.u8("delete tuple tag")? {
                b'K' | b'O' => {}
                other => {
                    return Err(r.err(format!("delete: expected 'K' or 'O', got 0x{other:02x}")))
                }
            }
            Message::Delete {
                relation_id,
                old: r.tuple()?,
            }
        }
        b'T' => {
            let n = r.u32("relation count")? as usize;
            let options = r.u8("truncate options")?;
            if n > (r.data.len() - r.pos) / 4 {
                return Err(r.err(format!("truncate claims {n} relations")));
            }
            let mut relation_ids = Vec::with_capacity(n);
            for _ in 0..n {
                relation_ids.push(r.u32("relation id")?);
            }
            Message::Truncate {
                options,
                relation_ids,
            }
        }
        b'M' => {
            let transactional = r.u8("message flags")? & 1 == 1;
            let lsn = r.u64("message LSN")?;
            let prefix = r.cstring("message prefix")?;
            let len = r.u32("message length")?;
            let content = r.take(len as usize, "message content")?;
            Message::Message {
                transactional,
                lsn,
                prefix,
                content,
            }
        }
        other => {
            return Err(DecodeError {
                offset: 0,
                what: format!("unknown message tag 0x{other:02x}"),
            })
        }
    };
    r.finish(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relation_bytes() -> Vec<u8> {
        let mut b = vec![b'R'];
        b.extend(16385u32.to_be_bytes());
        b.extend(b"public\0outbox\0");
        b.push(b'd');
        b.extend(2u16.to_be_bytes());
        b.push(1);
        b.extend(b"id\0");
        b.extend(2950u32.to_be_bytes());
        b.extend((-1i32).to_be_bytes());
        b.push(0);
        b.extend(b"payload\0");
        b.extend(114u32.to_be_bytes());
        b.extend((-1i32).to_be_bytes());
        b
    }

    #[test]
    fn decodes_relation_and_insert() {
        let m = decode(Bytes::from(relation_bytes())).unwrap();
        let Message::Relation(rel) = m else {
            panic!("not a relation: {m:?}")
        };
        assert_eq!(rel.name, "outbox");
        assert_eq!(rel.columns[1].name, "payload");
        assert_eq!(rel.columns[1].type_oid, 114);

        let mut b = vec![b'I'];
        b.extend(16385u32.to_be_bytes());
        b.push(b'N');
        b.extend(3u16.to_be_bytes());
        b.push(b't');
        b.extend(2u32.to_be_bytes());
        b.extend(b"{}");
        b.push(b'n');
        b.push(b'u');
        let m = decode(Bytes::from(b)).unwrap();
        assert_eq!(
            m,
            Message::Insert {
                relation_id: 16385,
                tuple: vec![
                    Value::Text(Bytes::from_static(b"{}")),
                    Value::Null,
                    Value::Unchanged
                ]
            }
        );
    }

    #[test]
    fn every_truncation_of_a_valid_message_is_an_error() {
        let full = relation_bytes();
        for n in 0..full.len() {
            assert!(
                decode(Bytes::copy_from_slice(&full[..n])).is_err(),
                "prefix {n}"
            );
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut seed = 0x2545F4914F6CDD1Du64;
        for len in 0..2000usize {
            let mut v = Vec::with_capacity(len % 64);
            for _ in 0..(len % 64) {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                v.push(seed as u8);
            }
            if let Some(first) = v.first_mut() {
                *first = b"BCORYIUDTMX"[len % 11];
            }
            let _ = decode(Bytes::from(v));
        }
        assert!(decode(Bytes::from_static(b"I\0\0\0\x01N\xff\xff")).is_err());
        assert!(decode(Bytes::from_static(b"Z")).is_err());
    }
}
