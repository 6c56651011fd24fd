//! The binlog source's unit tests: GTID sets carried in checkpoints choose a GTID resume;
//! server ids are stable per relay name and out of the way of real replicas.

use super::*;

#[test]
fn mysql_gtid_sets_ride_in_checkpoints_and_choose_gtid_resume() {
    let set =
        "3e11fa47-71ca-11e1-9e33-c80aa9429562:1-77,3e11fa47-71ca-11e1-9e33-c80aa9429562:blue:1-3";
    let r = Resume::from_mysql_head(admin::Head {
        file: "binlog.000007".into(),
        pos: 1234,
        gtid_executed: set.into(),
    });
    assert!(
        r.by_gtid(false),
        "MySQL with an executed set resumes by GTID"
    );
    let cp = r.checkpoint();
    assert!(cp.to_string().contains(":blue:1-3"), "{cp}");
    let back = Resume::from_checkpoint(&cp).unwrap();
    assert_eq!(back, r);
    let sids = back.mysql_gtids.as_ref().unwrap().to_sids();
    assert_eq!(sids.len(), 2);
    assert_eq!(
        sids[1].tag().map(|t| t.to_string()).as_deref(),
        Some("blue")
    );
    assert_eq!(
        sids[0].intervals()[0].end(),
        78,
        "intervals are half-open on the wire"
    );
    // Without GTIDs (gtid_mode=OFF): by file and position.
    let plain = Resume::from_mysql_head(admin::Head {
        file: "binlog.000007".into(),
        pos: 1234,
        gtid_executed: String::new(),
    });
    assert!(!plain.by_gtid(false));
    // A MariaDB state is no MySQL set.
    let maria = Resume::from_checkpoint(&Checkpoint::Binlog {
        file: "mariadb-bin.000002".into(),
        pos: 4,
        gtid_state: Some("0-1-6".into()),
    })
    .unwrap();
    assert!(maria.mysql_gtids.is_none() && maria.by_gtid(true) && !maria.by_gtid(false));
}

#[test]
fn server_ids_are_stable_and_out_of_the_way() {
    let a = server_id_for("billing");
    assert_eq!(a, server_id_for("billing"));
    assert_ne!(a, server_id_for("billing2"));
    assert!((0x4000_0000..0x8000_0000).contains(&a));
}
