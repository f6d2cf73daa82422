//! Listeners serving Firecracker's Uffd memory backend.

use proto::api::{CreateListener, ListenerDeleted, ListenerInfo, ListenerList};

use super::{body, Answer, Api};

impl Api {
    /// `POST /v1/firecracker/listeners` (201).
    pub fn try_add_listener(&self, req: &CreateListener) -> Answer<ListenerInfo> {
        self.call("POST", "/v1/firecracker/listeners", Some(body(req)), 201)
    }

    /// Add a Firecracker listener; panics unless 201.
    pub fn add_listener(&self, req: &CreateListener) -> ListenerInfo {
        self.try_add_listener(req)
            .unwrap_or_else(|r| panic!("listener {} failed: {r}", body(req)))
    }

    /// `GET /v1/firecracker/listeners`; panics unless 200.
    pub fn listeners(&self) -> Vec<ListenerInfo> {
        let l: ListenerList = self
            .call("GET", "/v1/firecracker/listeners", None, 200)
            .unwrap_or_else(|r| panic!("listing listeners failed: {r}"));
        l.listeners
    }

    /// Listener `id` as listed; panics if it is not.
    pub fn listener(&self, id: &str) -> ListenerInfo {
        self.listeners()
            .into_iter()
            .find(|l| l.id == id)
            .unwrap_or_else(|| panic!("listener {id} is not listed"))
    }

    /// `DELETE /v1/firecracker/listeners/{id}` (200).
    pub fn try_delete_listener(&self, id: &str) -> Answer<ListenerDeleted> {
        self.call(
            "DELETE",
            &format!("/v1/firecracker/listeners/{id}"),
            None,
            200,
        )
    }

    /// Delete a listener; panics unless 200.
    pub fn delete_listener(&self, id: &str) -> ListenerDeleted {
        self.try_delete_listener(id)
            .unwrap_or_else(|r| panic!("DELETE listener {id} failed: {r}"))
    }
}
