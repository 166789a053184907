"""The conversation list of the main window: new, rename, delete, switch; opening one shows it
from the Store and rebuilds the worker's Session from it (messages, then documents).

``conv_id`` is the open conversation (None only while none is selected yet).
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Qt
from PySide6.QtWidgets import QInputDialog, QListWidgetItem, QMenu, QMessageBox

from .protocol import OpenConversation
from .store import NotFound
from .window_surface import WindowSurface

NEW_TITLE = "New chat"
TITLE_CHARS = 48            # a first message longer than this is cut for the title


def transcript_messages(messages) -> list[dict]:
    """Store messages as the transcript shows them. An 'interrupted' answer whose stats say the
    user stopped it is marked ``stopped``; one without (cut off by a crash, a kill or the window
    closing) is shown as interrupted."""
    shown = []
    for m in messages:
        item = {"role": m.role, "content": m.content, "state": m.state}
        if m.state == "interrupted" and (m.stats or {}).get("finish_reason") == "cancelled":
            item["stopped"] = True
        if (m.stats or {}).get("retrieved"):  # the document sections the answer was shown
            item["sections"] = m.stats["retrieved"]
        shown.append(item)
    return shown


class ConversationsController(QObject):
    def __init__(self, window: WindowSurface):
        super().__init__(window)
        self.w = window
        self.conv_id: int | None = None
        lst = window.conv_list
        lst.currentItemChanged.connect(self._selected)
        lst.itemChanged.connect(self._renamed_in_place)
        lst.customContextMenuRequested.connect(self._menu)

    # -- the list -------------------------------------------------------------------------
    def reload(self, select: int | None) -> None:
        w = self.w
        conversations = w.store.list_conversations()
        if not conversations:
            conversations = [w.store.create_conversation(NEW_TITLE)]
        w.conv_list.blockSignals(True)
        w.conv_list.clear()
        for c in conversations:
            item = QListWidgetItem(c.title)
            item.setData(Qt.ItemDataRole.UserRole, c.id)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            item.setToolTip(c.title)
            w.conv_list.addItem(item)
        w.conv_list.blockSignals(False)
        target = select if select is not None else (self.conv_id or conversations[0].id)
        self._select_item(target)

    def _items(self):
        lst = self.w.conv_list
        return [lst.item(i) for i in range(lst.count())]

    def _select_item(self, conv_id: int) -> None:
        lst = self.w.conv_list
        for item in self._items():
            if item.data(Qt.ItemDataRole.UserRole) == conv_id:
                if lst.currentItem() is item:
                    if self.conv_id != conv_id:
                        self.open(conv_id)
                else:
                    lst.setCurrentItem(item)
                return
        if lst.count():
            lst.setCurrentRow(0)

    def _select_item_quietly(self, conv_id: int) -> None:
        lst = self.w.conv_list
        for item in self._items():
            if item.data(Qt.ItemDataRole.UserRole) == conv_id and lst.currentItem() is not item:
                lst.blockSignals(True)
                lst.setCurrentItem(item)
                lst.blockSignals(False)

    def ids(self) -> list[int]:
        return [item.data(Qt.ItemDataRole.UserRole) for item in self._items()]

    def _selected(self, current: QListWidgetItem | None, _previous=None) -> None:
        if current is not None:
            conv_id = current.data(Qt.ItemDataRole.UserRole)
            if conv_id != self.conv_id:
                self.open(conv_id)

    def _renamed_in_place(self, item: QListWidgetItem) -> None:
        w = self.w
        conv_id = item.data(Qt.ItemDataRole.UserRole)
        title = item.text().strip()
        try:
            current = w.store.conversation(conv_id).title
        except NotFound:
            return
        if not title:
            w.conv_list.blockSignals(True)
            item.setText(current)
            w.conv_list.blockSignals(False)
        elif title != current:
            w.store.rename_conversation(conv_id, title)
            item.setToolTip(title)

    def _menu(self, pos) -> None:
        lst = self.w.conv_list
        item = lst.itemAt(pos)
        menu = QMenu(self.w)
        menu.addAction("New chat", self.new)
        if item is not None:
            conv_id = item.data(Qt.ItemDataRole.UserRole)
            menu.addAction("Rename", lambda: lst.editItem(item))
            menu.addAction("Delete", lambda: self.delete(conv_id))
        menu.exec(lst.viewport().mapToGlobal(pos))

    # -- actions --------------------------------------------------------------------------
    def rename_current(self) -> None:
        item = self.w.conv_list.currentItem()
        if item is None:
            return
        title, ok = QInputDialog.getText(self.w, "Rename chat", "Title:", text=item.text())
        if ok and title.strip():
            self.rename(item.data(Qt.ItemDataRole.UserRole), title.strip())

    def rename(self, conv_id: int, title: str) -> None:
        self.w.store.rename_conversation(conv_id, title)
        for item in self._items():
            if item.data(Qt.ItemDataRole.UserRole) == conv_id:
                self.w.conv_list.blockSignals(True)
                item.setText(title)
                item.setToolTip(title)
                self.w.conv_list.blockSignals(False)

    def title_from_first_message(self, conv_id: int, text: str) -> None:
        """A conversation still called "New chat" takes its first message as its title."""
        if self.w.store.conversation(conv_id).title == NEW_TITLE:
            title = " ".join(text.split())
            self.rename(conv_id, title[:TITLE_CHARS] + ("…" if len(title) > TITLE_CHARS else ""))

    def new(self) -> int:
        conv = self.w.store.create_conversation(NEW_TITLE)
        self.reload(select=conv.id)
        self.w.input.setFocus()
        return conv.id

    def delete(self, conv_id: int | None, confirm: bool = True) -> None:
        w = self.w
        if conv_id is None:
            return
        try:
            title = w.store.conversation(conv_id).title
        except NotFound:
            return
        if confirm and QMessageBox.question(
                w, "Delete chat", f"Delete “{title}” with its messages and documents?") \
                != QMessageBox.StandardButton.Yes:
            return
        w.chat.stop_if_in(conv_id)
        w.store.delete_conversation(conv_id)
        if self.conv_id == conv_id:
            self.conv_id = None
        remaining = w.store.list_conversations()
        self.reload(select=remaining[0].id if remaining else None)

    def open(self, conv_id: int) -> None:
        """Shows a conversation and rebuilds the worker's Session from the Store (messages,
        then documents, re-added: their prefix comes back from the prefix cache)."""
        w = self.w
        w.chat.stop_unless_in(conv_id)
        self.conv_id = conv_id
        messages = w.store.messages(conv_id)
        w.transcript.set_messages(transcript_messages(messages))
        w.docs.show_stored(conv_id)
        w.chat.show_last_stats(messages)
        self._select_item_quietly(conv_id)
        self.open_in_worker()
        w.update_buttons()

    def show_messages(self, conv_id: int) -> None:
        """Re-renders the transcript from the Store (after messages were deleted)."""
        if conv_id == self.conv_id:
            self.w.transcript.set_messages(transcript_messages(self.w.store.messages(conv_id)))

    def model_changed(self) -> None:
        """A model was loaded: the open conversation gets a Session on it (or a new one)."""
        if self.conv_id is None:
            self.new()
        else:
            self.open_in_worker()

    def open_in_worker(self) -> None:
        w = self.w
        if w.models.model_info is None or self.conv_id is None:
            return
        conv = w.store.conversation(self.conv_id)
        messages = tuple({"role": m.role, "content": m.content} for m in w.store.messages(conv.id)
                         if m.role in ("user", "assistant") and (m.role == "user" or m.content))
        w.request(OpenConversation(conv.id, conv.system_prompt, messages,
                                   w.docs.stored_for_worker(conv.id), w.docs.mode_for(conv.id),
                                   w.docs.budget_for(conv.id)))
